"""Cross-island numerics check: ``python -m hethub_jax.check_numerics --plan PLAN`` (docs/numerics.md).

Every island of a plan runs the same model pieces with the same weights and inputs, and the reporting
process (rank 0, or the only process) compares them, per row:

* ``embedding`` (token ids -> hidden), ``layer 0`` .. ``layer L-1`` (decoder layers), ``head`` (final
  RMSNorm + LM head -> logits), ``loss`` (mean next-token cross-entropy from the logits, float32);
* ``end-to-end loss``: each island's loss from its own chain of all the pieces, errors compounding.

Each piece is fed the *reference island's* input to that piece (its output of the previous piece),
not the island's own: a difference in one layer then shows in that layer's row only, and the first
row beyond tolerance is the layer that differs (with each island's own chain, one bad layer would
make every later row differ too). The end-to-end row shows what the user finally sees.

Columns: the largest absolute difference and the normwise relative difference
``max|a - b| / max|b|`` of each island's output ``a`` against (1) the reference island's output and
(2) a float64 numpy reference (``hethub_jax.models.numpy_reference``) fed the same input. Tolerances
are per row from the compute dtype's unit roundoff (see :func:`tolerance`). Weights come from the
model's deterministic initialisation (``--seed``; equal on every island), the tokens from a fixed
seeded batch.

Processes: under ``mpiexec`` one process per island as in training (``hethub_jax.train`` start-up:
``JAX_PLATFORMS`` per island before jax is imported, world split by island, handshake); the reference
island broadcasts its per-piece inputs over the communicator contract (``hethub_jax.comm``) and every
island sends its outputs to rank 0. Without ``mpiexec`` all islands run in one process, each on device
0 of its platform (on a CPU-only machine that is the same backend for every island).

Exit status: 0 all rows within tolerance; 1 a row beyond tolerance (the message names the first row,
island and comparison); 2 bad input (one line on stderr, before any computation).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["main", "build_parser", "UNIT_ROUNDOFF", "GROWTH", "ACCUMULATION", "ISLAND_FACTOR", "tolerance",
           "row_specs", "RowSpec", "make_tokens", "IslandModel", "compare", "format_report", "EXIT_BEYOND_TOLERANCE",
           "EXIT_BAD_INPUT"]

_PROG = "python -m hethub_jax.check_numerics"
EXIT_BEYOND_TOLERANCE = 1
EXIT_BAD_INPUT = 2
_TAG = 7100

#: Unit roundoff u = 2^-p of a format with p significand bits (IEEE 754-2008 binary32 p = 24,
#: binary16 p = 11; bfloat16 p = 8, Google's bfloat16 definition / Intel BF16 white paper).
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
#: Roundings to the compute dtype on one piece's path, each worth at most u relative: a decoder layer
#: rounds about eight intermediate tensors (normed input, q/k/v, probabilities, attention output,
#: residual sums, SwiGLU product) plus its weights; with independent errors their sum grows more slowly
#: than their count, so GROWTH * u bounds a piece (measured on CPU: at most 2.0 u for float16 and
#: 1.5 u for bfloat16 layers of the tiny model, docs/numerics.md).
GROWTH = 8.0
#: lambda of the probabilistic bound lambda * sqrt(n) * u of an n-term float32 inner product or sum
#: (Higham & Mary 2019, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput.
#: 41(5), A2815-A2835; the deterministic bound is n * u, Higham 2002, "Accuracy and Stability of
#: Numerical Algorithms", section 3.1). Long reductions run in float32 whatever the compute dtype: the
#: model keeps norms and softmax in float32 and XLA accumulates bfloat16/float16 dots in float32.
ACCUMULATION = 4.0
#: Two islands each within t of the exact result are within 2 t of each other.
ISLAND_FACTOR = 2.0


def tolerance(dtype: str, n: int, *, against: str = "float64", chain: int = 1) -> float:
    """Normwise relative tolerance of a row (dimensionless):
    ``chain * (GROWTH * u(dtype) + ACCUMULATION * sqrt(n) * u(float32))``, times ``ISLAND_FACTOR``
    against another island.

    Args:
      dtype: the format the row's result is rounded to ("float32", "bfloat16", "float16").
      n: the longest reduction (inner-product or sum length) in the row's computation.
      against: "float64" (the stand-in for exact arithmetic) or "island" (another island).
      chain: pieces compounding in the row (the end-to-end loss: every piece of the model; residual
        layers pass a relative error on roughly unamplified, so the errors add).

    Raises:
      ValueError: unknown dtype or ``against``, or ``n < 1``.
    """
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff for dtype {dtype!r}; known: {sorted(UNIT_ROUNDOFF)}")
    if against not in ("float64", "island") or n < 1:
        raise ValueError(f"tolerance needs against in ('float64', 'island') and n >= 1, got {against!r}, {n}")
    t = chain * (GROWTH * UNIT_ROUNDOFF[dtype] + ACCUMULATION * math.sqrt(n) * UNIT_ROUNDOFF["float32"])
    return t * (ISLAND_FACTOR if against == "island" else 1.0)


@dataclass(frozen=True)
class RowSpec:
    """One compared row: ``name``, the dtype its result is rounded to, its longest reduction ``n``
    and ``chain`` (pieces compounding in it)."""

    name: str
    dtype: str
    n: int
    chain: int = 1


def row_specs(config: Any, batch: int, seq_len: int) -> list[RowSpec]:
    """The rows in order. Reductions: embedding none (a gather; n = 1); decoder layer
    max(D, H * Dh, F, S) (projections, attention over S, RMSNorm mean over D); head D; loss (float32
    throughout) max(V, B * (S - 1)) (log-sum-exp over V, mean over the tokens); end-to-end loss the
    largest of these, chained over all L + 3 pieces."""
    c, dt = config, config.dtype
    n_layer = max(c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size, seq_len)
    n_loss = max(c.vocab_size, batch * (seq_len - 1))
    rows = [RowSpec("embedding", dt, 1)]
    rows += [RowSpec(f"layer {i}", dt, n_layer) for i in range(c.num_hidden_layers)]
    rows += [RowSpec("head", dt, c.hidden_size), RowSpec("loss", "float32", n_loss)]
    rows.append(RowSpec("end-to-end loss", dt, max(n_layer, n_loss), chain=c.num_hidden_layers + 3))
    return rows


def make_tokens(vocab_size: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    """The fixed token batch ``[batch, seq_len] int32``, uniform over the vocabulary, from ``seed``."""
    return np.random.default_rng([seed, 0x6e756d]).integers(0, vocab_size, (batch, seq_len)).astype(np.int32)


# ---- the island side: the model under test, piece by piece -----------------------------------------
class IslandModel:
    """The Flax Llama (``models.llama``, initialised from ``seed``) on one JAX ``device``, callable
    piece by piece with jitted functions. Inputs are host arrays; outputs come back as numpy arrays in
    the compute dtype (the loss: a float32 0-d array)."""

    def __init__(self, config: Any, seed: int, device: Any):
        import jax

        from hethub_jax.models.llama import Llama

        self.config, self.device = config, device
        with jax.default_device(device):
            self.model = Llama(config, seed=seed)
        self._fns = None

    def host_weights(self) -> dict[str, np.ndarray]:
        """Flat name -> host copy of every parameter (``Llama.param_table`` names)."""
        return {k: np.asarray(p[...]) for k, p in self.model.param_table().items()}

    def perturb(self, piece: str, scale: float, seed: int) -> list[str]:
        """For testing the checker: multiply every weight of ``piece`` ("embedding", "layer K",
        "head") by ``1 + scale * z``, z ~ N(0, 1) drawn from ``seed``. Returns the names changed.
        "head" is the final norm and, when untied, the LM head; with tied embeddings "embedding"
        changes the head too (one matrix)."""
        import jax.numpy as jnp

        table = self.model.param_table()
        if piece == "embedding":
            names = ["embed_tokens"]
        elif piece == "head":
            names = [n for n in ("norm", "lm_head") if n in table]
        else:
            names = [n for n in table if n.startswith(f"layers.{piece.split()[1]}.")]
        rng = np.random.default_rng(seed)
        for n in names:
            w = np.asarray(table[n][...]).astype(np.float32)
            noisy = w * (1.0 + np.float32(scale) * rng.standard_normal(w.shape, dtype=np.float32))
            table[n][...] = jnp.asarray(noisy, dtype=table[n][...].dtype)
        self._fns = None
        return names

    def _compile(self) -> dict[str, Any]:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from hethub_jax.models.llama import rope_cos_sin

        g_model, s_model = nnx.split(self.model)
        g_layer, _ = nnx.split(self.model.layers[0])
        layer_states = [nnx.split(layer)[1] for layer in self.model.layers]

        def loss(logits, tokens):
            z = logits[:, :-1].astype(jnp.float32)
            ce = jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, tokens[:, 1:, None], -1)[..., 0]
            return jnp.mean(ce)

        def cos_sin(tokens):
            pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
            return rope_cos_sin(self.config, pos)

        return {"state": s_model, "layers": layer_states,
                "embed": jax.jit(lambda s, t: nnx.merge(g_model, s).embed(t)),
                "layer": jax.jit(lambda s, x, c, si: nnx.merge(g_layer, s)(x, c, si)),
                "head": jax.jit(lambda s, x: nnx.merge(g_model, s).head(x)),
                "loss": jax.jit(loss), "cos_sin": jax.jit(cos_sin)}

    def piece(self, index: int, x: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Output of piece ``index`` (0 embedding, 1..L layers, L+1 head, L+2 loss) for input ``x``."""
        import jax

        f = self._fns = self._fns or self._compile()
        put = lambda a: jax.device_put(np.asarray(a), self.device)  # noqa: E731
        n = self.config.num_hidden_layers
        if index == 0:
            out = f["embed"](f["state"], put(tokens))
        elif index <= n:
            c, s = f["cos_sin"](put(tokens))
            out = f["layer"](f["layers"][index - 1], put(x), c, s)
        elif index == n + 1:
            out = f["head"](f["state"], put(x))
        else:
            out = f["loss"](put(x), put(tokens))
        return np.asarray(out)

    def chain(self, tokens: np.ndarray) -> list[np.ndarray]:
        """Own chain: ``[embedding out, layer outs..., logits, loss]`` (each piece fed the previous)."""
        outs = [self.piece(0, tokens, tokens)]
        for i in range(1, self.config.num_hidden_layers + 3):
            outs.append(self.piece(i, outs[-1], tokens))
        return outs

    def outputs(self, ref_inputs: list[np.ndarray], tokens: np.ndarray) -> list[np.ndarray]:
        """Outputs of every piece fed ``ref_inputs[i]`` (the reference island's input to piece i),
        then this island's own end-to-end loss."""
        outs = [self.piece(i, x, tokens) for i, x in enumerate(ref_inputs)]
        return outs + [self.chain(tokens)[-1]]


def reference_outputs(config: Any, weights: dict[str, np.ndarray], ref_inputs: list[np.ndarray],
                      tokens: np.ndarray) -> list[np.ndarray]:
    """The float64 numpy reference of every row: each piece fed the reference island's input to it
    (converted to float64), then the float64 end-to-end loss from the tokens."""
    from hethub_jax.models import numpy_reference as ref

    n = config.num_hidden_layers
    outs = [ref.embed(tokens, weights)]
    outs += [ref.decoder_layer(ref_inputs[i + 1], weights, i, config) for i in range(n)]
    outs.append(ref.head(ref_inputs[n + 1], weights, config))
    outs.append(ref.next_token_loss(ref_inputs[n + 2], tokens))
    return outs + [ref.forward_chain(tokens, weights, config)[-1]]


# ---- comparison and report ------------------------------------------------------------------------
def _diff(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max |a - b|, max |a - b| / max |b|) in float64; rel is inf when b is all zero and a is not."""
    a64, b64 = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"shapes differ: {a64.shape} vs {b64.shape}")
    d = float(np.max(np.abs(a64 - b64))) if a64.size else 0.0
    scale = float(np.max(np.abs(b64))) if b64.size else 0.0
    rel = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
    return d, (rel if math.isfinite(d) else math.inf)


def compare(specs: list[RowSpec], outputs: dict[str, list[np.ndarray]], reference_island: str,
            exact: list[np.ndarray]) -> dict[str, Any]:
    """Rows of the report: for each row and island the differences against the reference island and
    against float64, the tolerances, and ``ok``; plus ``first_failure`` (None when all pass).

    ``outputs``: island name -> its row outputs (order of ``specs``); ``exact``: float64 outputs."""
    rows, first = [], None
    for k, spec in enumerate(specs):
        t64 = tolerance(spec.dtype, spec.n, against="float64", chain=spec.chain)
        tis = tolerance(spec.dtype, spec.n, against="island", chain=spec.chain)
        per = {}
        for name, outs in outputs.items():
            a_i, r_i = _diff(outs[k], outputs[reference_island][k])
            a_f, r_f = _diff(outs[k], exact[k])
            ok_i, ok_f = r_i <= tis, r_f <= t64
            per[name] = {"max_abs_vs_island": a_i, "max_rel_vs_island": r_i, "max_abs_vs_float64": a_f,
                         "max_rel_vs_float64": r_f, "ok": bool(ok_i and ok_f)}
            if first is None and not (ok_i and ok_f):
                against = f"island {reference_island}" if not ok_i else "float64"
                first = {"row": spec.name, "island": name, "against": against,
                         "max_rel": r_i if not ok_i else r_f, "tolerance": tis if not ok_i else t64}
        rows.append({"name": spec.name, "dtype": spec.dtype, "n": spec.n, "chain": spec.chain,
                     "tol_vs_float64": t64, "tol_vs_island": tis, "islands": per})
    return {"rows": rows, "first_failure": first, "passed": first is None}


def format_report(report: dict[str, Any]) -> list[str]:
    """Readable lines: one per row and island (abs and relative differences, tolerances, ok)."""
    ref = report["reference_island"]
    lines = [f"numerics check: plan {report['plan']}, compute dtype {report['dtype']}, reference island "
             f"{ref}, batch {report['batch']} x {report['seq_len']} tokens, seed {report['seed']}",
             *(f"  island {n}: platform {i['platform']}, device {i['device']}" for n, i in report["islands"].items())]
    if report.get("perturb"):
        p = report["perturb"]
        lines.append(f"  TESTING THE CHECKER: island {p['island']} {p['piece']} weights perturbed by "
                     f"relative noise {p['scale']:g} ({', '.join(p['names'])})")
    lines.append(f"{'row':<16} {'island':<10} {'abs vs ' + ref:>14} {'rel vs ' + ref:>14} {'tol':>9} "
                 f"{'abs vs f64':>11} {'rel vs f64':>11} {'tol':>9}  ok")
    for row in report["rows"]:
        for name, d in row["islands"].items():
            lines.append(f"{row['name']:<16} {name:<10} {d['max_abs_vs_island']:>14.3e} "
                         f"{d['max_rel_vs_island']:>14.3e} {row['tol_vs_island']:>9.2e} "
                         f"{d['max_abs_vs_float64']:>11.3e} {d['max_rel_vs_float64']:>11.3e} "
                         f"{row['tol_vs_float64']:>9.2e}  {'ok' if d['ok'] else 'FAIL'}")
    f = report["first_failure"]
    lines.append("PASSED: every row within tolerance" if f is None else
                 f"FAILED: first row beyond tolerance: {f['row']} on island {f['island']} against "
                 f"{f['against']} (relative {f['max_rel']:.3e} > tolerance {f['tolerance']:.2e})")
    return lines


# ---- command line -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description="Compare the numerics of every island of a plan "
                                "layer by layer against one island and a float64 reference (docs/numerics.md).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--plan", metavar="PLAN.json", required=True, help="parallel plan JSON (its islands)")
    p.add_argument("--config", metavar="PATH", default=None,
                   help="training YAML config whose model section is used; default the tiny preset")
    p.add_argument("--set", dest="overrides", metavar="SECTION.FIELD=VALUE", action="append", default=[],
                   help="override one config field (as in hethub_jax.train), e.g. --set model=tiny")
    p.add_argument("--reference-island", metavar="NAME", default=None,
                   help="island the others are compared with; default the plan's first island")
    p.add_argument("--dtype", choices=sorted(UNIT_ROUNDOFF), default=None,
                   help="compute dtype (model.dtype); default the config's")
    p.add_argument("--batch-size", type=int, default=2, help="samples in the fixed token batch")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the token batch")
    p.add_argument("--matmul-precision", choices=("default", "high", "highest"), default=None,
                   help="jax_default_matmul_precision on every island (e.g. 'highest' to rule out "
                        "TF32 float32 matmuls on NVIDIA GPUs); default JAX's")
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the report as JSON")
    p.add_argument("--island", metavar="NAME", default=None, help="this process's island (MPI runs)")
    t = p.add_argument_group("testing the checker (not for real runs)")
    t.add_argument("--perturb-island", metavar="NAME", default=None,
                   help="island whose weights of --perturb-layer get relative noise")
    t.add_argument("--perturb-layer", metavar="K", default=None,
                   help="decoder layer index K, or 'embedding' or 'head'")
    t.add_argument("--perturb-scale", metavar="EPS", type=float, default=1e-3,
                   help="relative noise: each weight w becomes w * (1 + EPS * z), z ~ N(0, 1)")
    return p


def _fail(msg: str) -> int:
    print(f"{_PROG}: error: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _piece_name(layer: str, num_layers: int) -> str:
    """``--perturb-layer`` value -> row name ("embedding", "layer K", "head"). Raises ValueError."""
    if layer in ("embedding", "head"):
        return layer
    if layer.lstrip("-").isdigit() and 0 <= int(layer) < num_layers:
        return f"layer {int(layer)}"
    raise ValueError(f"--perturb-layer must be 'embedding', 'head' or a decoder layer index in "
                     f"[0, {num_layers}), got {layer!r}")


def _load(args: argparse.Namespace) -> tuple[Any, Any, str | None]:
    """Plan, model config (with ``--dtype``) and the perturbed piece's row name, all checked before any
    work. Raises ValueError (naming the flag or field) or OSError."""
    from hethub_jax.config import load_config
    from hethub_jax.models.config import LlamaConfig
    from hethub_jax.parallel.plan import Plan

    try:
        plan = Plan.from_json(args.plan)
    except FileNotFoundError:
        raise ValueError(f"--plan: file not found: {args.plan}") from None
    config = load_config(args.config, args.overrides).model
    if args.dtype is not None:
        config = LlamaConfig(**{**config.to_dict(), "dtype": args.dtype})
    if config.dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"model.dtype {config.dtype!r} has no documented tolerance; use one of "
                         f"{sorted(UNIT_ROUNDOFF)}")
    plan.validate(config)
    names = [i.name for i in plan.islands]
    for flag, value in (("--reference-island", args.reference_island), ("--perturb-island", args.perturb_island)):
        if value is not None and value not in names:
            raise ValueError(f"{flag} {value!r} is not an island of the plan: {names}")
    if args.batch_size < 1 or not 2 <= args.seq_len <= config.max_position_embeddings:
        raise ValueError(f"--batch-size must be >= 1 and --seq-len in [2, model.max_position_embeddings="
                         f"{config.max_position_embeddings}], got {args.batch_size} and {args.seq_len}")
    if (args.perturb_island is None) != (args.perturb_layer is None):
        raise ValueError("--perturb-island and --perturb-layer go together (testing the checker)")
    if not (math.isfinite(args.perturb_scale) and args.perturb_scale > 0):
        raise ValueError(f"--perturb-scale must be finite and > 0, got {args.perturb_scale}")
    piece = None if args.perturb_layer is None else _piece_name(args.perturb_layer, config.num_hidden_layers)
    return plan, config, piece


def _island_model(config: Any, args: argparse.Namespace, island: str, device: Any, piece: str | None
                  ) -> tuple[IslandModel, dict[str, np.ndarray], list[str] | None]:
    """The island's model, the unperturbed host weights, and the perturbed names (None: not perturbed)."""
    model = IslandModel(config, args.seed, device)
    weights = model.host_weights()
    names = None
    if piece is not None and island == args.perturb_island:
        names = model.perturb(piece, args.perturb_scale, seed=args.seed + 1)
    return model, weights, names


def _report(args, plan, config, outputs, exact, devices: dict[str, str], perturbed) -> dict[str, Any]:
    specs = row_specs(config, args.batch_size, args.seq_len)
    report = {"plan": args.plan, "dtype": config.dtype, "reference_island": _reference(args, plan),
              "batch": args.batch_size, "seq_len": args.seq_len, "seed": args.seed,
              "matmul_precision": args.matmul_precision or "jax default",
              "model": config.to_dict(),
              "islands": {i.name: {"platform": i.platform, "device": devices[i.name]} for i in plan.islands},
              "relative_difference": "max|a - b| / max|b| over the row's output (normwise, max norm)",
              "tolerance": f"chain * ({GROWTH:g} * u(dtype) + {ACCUMULATION:g} * sqrt(n) * u(float32)); "
                           f"x {ISLAND_FACTOR:g} against an island (docs/numerics.md)",
              "unit_roundoff": dict(UNIT_ROUNDOFF),
              "perturb": None if perturbed is None else {
                  "island": args.perturb_island, "piece": perturbed[0], "scale": args.perturb_scale,
                  "names": perturbed[1], "note": "testing the checker: deliberately perturbed weights"}}
    report.update(compare(specs, outputs, report["reference_island"], exact))
    return report


def _reference(args: argparse.Namespace, plan: Any) -> str:
    return args.reference_island or plan.islands[0].name


def _finish(report: dict[str, Any], json_out: str | None) -> int:
    print("\n".join(format_report(report)), flush=True)
    if json_out is not None:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1, default=float)
    return 0 if report["passed"] else EXIT_BEYOND_TOLERANCE


def _set_precision(precision: str | None) -> None:
    if precision is not None:
        import jax

        jax.config.update("jax_default_matmul_precision", precision)


def _run_local(args: argparse.Namespace, plan: Any, config: Any, piece: str | None) -> int:
    """All islands in this process, each on device 0 of its platform."""
    import jax

    _set_precision(args.matmul_precision)
    devices = {}
    for isl in plan.islands:  # every platform present before any work
        try:
            devices[isl.name] = jax.devices(isl.platform)[0]
        except RuntimeError as e:
            return _fail(f"island {isl.name}: platform {isl.platform!r} is not available in this process "
                         f"({e}); run one process per island under mpiexec")
    models, weights, perturbed = {}, None, None
    for isl in plan.islands:
        models[isl.name], w, names = _island_model(config, args, isl.name, devices[isl.name], piece)
        weights = w if weights is None else weights
        perturbed = (piece, names) if names is not None else perturbed
    tokens = make_tokens(config.vocab_size, args.batch_size, args.seq_len, args.seed)
    ref_chain = models[_reference(args, plan)].chain(tokens)
    inputs = [tokens] + ref_chain[:-1]
    outputs = {name: m.outputs(inputs, tokens) for name, m in models.items()}
    exact = reference_outputs(config, weights, inputs, tokens)
    devices = {k: str(d) for k, d in devices.items()}
    return _finish(_report(args, plan, config, outputs, exact, devices, perturbed), args.json_out)


def _run_mpi(args: argparse.Namespace, plan: Any, config: Any, piece: str | None, size: int) -> int:
    """One process per island (``hethub_jax.train`` start-up). The reference island broadcasts its
    inputs to each piece; every island sends its outputs to rank 0, which reports; all ranks return
    rank 0's status."""
    from hethub_jax import cluster
    from hethub_jax.train import start_mpi

    multi = [i.name for i in plan.islands if i.num_processes > 1]
    if multi:
        return _fail(f"islands {multi} have num_processes > 1: the numerics check runs one process per "
                     f"island (set num_processes to 1, or run without mpiexec)")
    try:
        island = start_mpi(args.plan, args.island, size)
    except ValueError as e:
        if "mpi4py.MPI" not in sys.modules:  # before MPI started: end the other ranks at the start-up gate
            _fail(str(e))
            try:
                cluster.join_job(error=str(e))
            except cluster.StartFailed:
                pass
            return EXIT_BAD_INPUT
        return _fail(str(e))
    except cluster.StartFailed as e:
        return _fail(str(e))
    import jax

    _set_precision(args.matmul_precision)
    world = island.world
    settings = {k: getattr(args, k) for k in ("reference_island", "dtype", "batch_size", "seq_len", "seed",
                                              "matmul_precision", "perturb_island", "perturb_layer", "perturb_scale")}
    digest = cluster.config_hash(config.to_dict(), plan.to_dict(), settings)
    cluster.handshake(world, cluster.handshake_record(digest, island.name, island.platform, jax.local_device_count()))
    device = jax.local_devices()[0]
    model, weights, names = _island_model(config, args, island.name, device, piece)
    tokens = make_tokens(config.vocab_size, args.batch_size, args.seq_len, args.seed)
    ref_rank = plan.island_ranks(_reference(args, plan)).start
    mine = [tokens] + model.chain(tokens)[:-1] if world.rank == ref_rank else None
    inputs = [world.broadcast(mine[i] if mine else None, root=ref_rank)
              for i in range(config.num_hidden_layers + 3)]
    outs = model.outputs(inputs, tokens)
    gathered = _gather(world, plan, island.name, outs, str(device), names)
    status = 0
    if world.rank == 0:
        outputs, devices, perturbed = gathered
        exact = reference_outputs(config, weights, inputs, tokens)
        perturbed = (piece, perturbed) if perturbed is not None else None
        status = _finish(_report(args, plan, config, outputs, exact, devices, perturbed), args.json_out)
    return int(world.broadcast(np.array([status], np.int32), root=0)[0])


def _gather(world: Any, plan: Any, name: str, outs: list[np.ndarray], device: str, perturbed):
    """Every island's outputs, device string and perturbed names to rank 0 (send/recv of the
    communicator contract). Returns (outputs by island, devices by island, perturbed names or None)
    on rank 0, None elsewhere."""
    meta = np.frombuffer(json.dumps({"device": device, "perturbed": perturbed}).encode(), np.uint8)
    if world.rank != 0:
        world.send(meta, 0, _TAG)
        for k, o in enumerate(outs):
            world.send(o, 0, _TAG + 1 + k)
        return None
    outputs, devices, names = {}, {}, perturbed
    for isl in plan.islands:  # report in plan order
        r = plan.island_ranks(isl.name).start
        if r == 0:
            outputs[isl.name], devices[isl.name] = outs, device
            continue
        m = json.loads(bytes(world.recv(r, _TAG)))
        devices[isl.name] = m["device"]
        names = m["perturbed"] if m["perturbed"] is not None else names
        outputs[isl.name] = [world.recv(r, _TAG + 1 + k) for k in range(len(outs))]
    return outputs, devices, names


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check. Returns 0 (within tolerance), 1 (beyond tolerance), 2 (bad input)."""
    args = build_parser().parse_args(argv)
    try:
        plan, config, piece = _load(args)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    from hethub_jax.train import mpi_world_size

    size = mpi_world_size()
    if size > 1:
        return _run_mpi(args, plan, config, piece, size)
    if args.island is not None:
        return _fail(f"--island {args.island}: only under mpiexec (one process per island); without it "
                     f"every island runs in this process")
    return _run_local(args, plan, config, piece)


if __name__ == "__main__":
    sys.exit(main())
