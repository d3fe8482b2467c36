"""Profiler: measures one island's device type and writes a profile JSON (DESIGN.md section 7).

Run once per island (device type): ``python -m hethub_jax.profile --out profiles/cpu.json``; under
``mpiexec -n 2`` rank 0 also measures the MPI bridge to rank 1 (ping-pong); alone it skips the MPI
bridge, says so, and measures the in-process bridge (``LocalCommunicator`` between two threads). A few
minutes at most (about 2-4 minutes for the tiny model with ``--tp 1,2 --dp 1,2`` on 2 CPU cores).

What is measured, with the runtime's own code paths (``hethub_jax.parallel.stage.PipelineStage``):
  * per TP degree and microbatch size, the four stage calls the runtime makes -- ``forward_saving``
    (phase ``F``), ``forward`` (``F_nosave``), ``backward_saved`` (``B``) and
    ``backward_recompute`` / the last stage's fused ``forward_backward`` (``B_recompute``) -- on four
    stages: the first (layer 0, embedding), two middle ones (one and two layers) and the last (LM
    head and loss), each call including the runtime's placement of its host inputs; then per phase
    the fixed cost of a call (``base``), a layer's, the embedding's and the LM head + loss's,
    ``head``, fitted jointly by least squares (numpy, :func:`fit_compute`) as ``c0 + c1 x`` with x the
    layer's / head's forward FLOPs (``hethub_jax.planner.analytic``) or the tokens (embedding);
  * the optimizer update (``PipelineStage.update``, AdamW) of the four stages: ``c0 + c1 x params``;
  * the device <-> host copy of activation-sized arrays (``jax.device_get`` / ``jax.device_put``),
    the in-island all-reduce (``psum`` over the island's devices) and the runtime's sum of gradients
    held by several stages (tied embeddings, DP replicas; :func:`measure_shared_sum`):
    ``c0 + c1 x bytes``;
  * the runtime's tail after the pipeline in the runtime's state (:func:`measure_shared_sum`: right
    after a real step's pipeline): the gradient sums, each stage's part of the global norm
    (``norm``: ``c0 + c1 x counted parameters``) and the update's extra per parameter over the same
    call repeated at once (``update_cold``); unless ``--no-runtime``, the same sums with the stages on
    each profiled ``(1, tp)`` / ``(dp, 1)`` mesh over on one device (:func:`measure_shared_sum_mesh`,
    ``shared_sum_mesh``);
  * the bridge (``MPIHostBridge`` send/recv round trips, under mpiexec): ``c0 + c1 x bytes``;
  * the bridge's all-reduce (``MPIHostBridge.allreduce_tree``, as training sums the shared gradients across
    islands; under mpiexec -n 2, both ranks; :func:`measure_bridge_allreduce`): ``fits.bridge_allreduce``,
    ``c0 + c1 x bytes`` (alpha and 1 / beta, both >= 0: :func:`fit_bridge_allreduce`);
  * with ``--stage-shapes``: whole stages of the given layer ranges (e.g. the whole model, every
    one-stage replica's shape), the same four calls, used for stages of that shape instead of the
    fits (:func:`profile_stage_shapes`: seconds per layer rise with the layers of a call on a CPU core);
  * with the whole model in ``--stage-shapes`` (every heterogeneous-DP replica's shape): the bucketed
    all-reduce's chunked last microbatch against the fused one, and the same with the bucket thread's host
    copies (:func:`measure_chunked_last`, ``fits.chunked_last``; ``--chunked-mbs``);
  * with ``--dp``: the stages on ``(dp, 1)`` meshes; on CPU (``--corun``) the slowdown of stage calls
    while a second island of the process computes, beside a larger and a smaller neighbour call
    (:func:`measure_corun`) and of two islands' optimizer
    updates run at the same time, as after a step's pipeline (:func:`measure_update_pair`; and, unless
    ``--no-runtime``, in the runtime's own two-island step, together against one at a time:
    :func:`measure_tail_pair`, which ``fits.corun_update`` then uses); the runtime's own seconds
    per action (:func:`measure_runtime_overhead`), of its SEND, RECV and fused-B records and between
    records (:func:`measure_action_costs`), and what its emulated wait takes (:func:`measure_emulated_wait`);
  * unless ``--no-runtime``, each stage call with 1-4 microbatches in flight (residuals or inputs held,
    as GPipe holds them) over the same call alone (:func:`measure_in_flight`, ``fits.in_flight``).
Each figure is the median of ``--repeats`` timed calls after one untimed call (compilation).
With ``--pin`` the profiler runs on one core and its co-run neighbour process on another (recorded as
``pinned``), as island processes pinned one core each run; the updates' pair is then not measured.
Per phase of the profile (compute fits, stage shapes, co-run, ..., chunked last microbatch), the JSON's
``phases`` records its wall seconds and the process's peak resident set (VmHWM) at its end and how much the
phase raised it (:class:`PhaseLog`; a progress line per phase on stderr unless ``--no-progress``), so that
a profile's peak memory can be traced to its phase.
The process's host allocator is set as ``PipelineRuntime`` sets it for CPU islands
(``hethub_jax.host_allocator``, recorded as ``host_allocator``), so that a call costs here what it
costs in a pipeline (with glibc's defaults XLA:CPU's large buffers are mmapped and faulted in again on
every call, depending on what ran before).
An emulated slowdown (``--slowdown f``, DESIGN.md section 9) multiplies every compute and update
time by f (what the runtime's wait adds) and is recorded as ``emulated_slowdown``.
``hethub_jax.planner.costs.DeviceCosts.from_profile`` reads the file.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hethub_jax.planner import analytic
from hethub_jax.planner.costs import PROFILE_FORMAT

PHASES = ("F", "F_nosave", "B", "B_recompute")
STAGE_KINDS = ("first", "mid1", "mid2", "last")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hethub_jax.profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="model preset (hethub_jax.models.config.PRESETS) or a JSON file "
                                                   "of LlamaConfig fields")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    p.add_argument("--microbatch-sizes", default="1,2,4", help="comma-separated samples per microbatch")
    p.add_argument("--tp", default="1", help="comma-separated TP degrees (fake CPU devices are added as needed)")
    p.add_argument("--dp", default="1", help="comma-separated DP degrees: a (dp, 1) stage mesh is profiled for each "
                                            "dp > 1 (on CPU its fake devices share the same cores)")
    p.add_argument("--dp-microbatch-sizes", default=None,
                   help="comma-separated samples PER DP RANK at which the (dp, 1) meshes are profiled (a dp-way "
                        "mesh runs dp x each); default: --microbatch-sizes")
    p.add_argument("--corun", choices=("auto", "on", "off"), default="auto",
                   help="measure the slowdown of a computation while a second island of this process computes "
                        "on other devices (auto: on the cpu platform, whose devices share the host's cores)")
    p.add_argument("--corun-neighbour", choices=("thread", "process"), default="thread",
                   help="the co-run slowdown's neighbour island (fits.corun): a second thread of this process "
                        "(default), or a process of its own, as islands under mpiexec are")
    p.add_argument("--pin", action="store_true",
                   help="pin this profiler to its first usable core and the co-run neighbour process to the second, "
                        "before JAX starts, as two island processes pinned one core each (benchmarks/"
                        "predictor_accuracy.py --pin; hethub_jax.train pins CPU islands likewise): every call is then "
                        "timed on one core, and the co-run slowdown is that of two pinned cores. Needs 2 usable "
                        "cores and, when the co-run is measured, --corun-neighbour process; one profiler process only "
                        "(not a multi-rank mpiexec, whose ranks pin themselves)")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per figure (median)")
    p.add_argument("--device-type", default=None, help="name of the device type (default: the JAX platform)")
    p.add_argument("--slowdown", type=float, default=1.0, help="emulated slowdown factor >= 1 (cpu only)")
    p.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="statistic over the timed calls of each figure (min: for a machine shared with other jobs)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-runtime", action="store_true",
                   help="skip the runtime's per-action seconds, the cold calls, the calls with microbatches in "
                        "flight and the in-process bridge (a brief profile)")
    p.add_argument("--no-bridge", action="store_true",
                   help="do not measure the MPI bridge (every rank under mpiexec profiles its own island)")
    p.add_argument("--stage-shapes", default="",
                   help="comma-separated layer ranges FIRST-LAST (e.g. 0-7: the whole model) also measured as whole "
                        "stages at every microbatch size and TP degree (kind 'stage_shape'); the predictor then uses "
                        "these measured seconds for a stage of that shape instead of the fitted lines")
    p.add_argument("--chunked-mbs", default="auto",
                   help="comma-separated microbatch sizes at which the bucketed all-reduce's chunked last microbatch "
                        "is timed against the fused one on the whole-model stage (measure_chunked_last, "
                        "fits.chunked_last), with or without --stage-shapes; auto: with the whole model in "
                        f"--stage-shapes, the profiled sizes up to {16}, else skipped; none: skip")
    p.add_argument("--job-pids", default="",
                   help="comma-separated process ids of this job's other processes on this machine (e.g. MPI ranks "
                        "profiling their own cores at the same time): their CPU time is not counted as other "
                        "processes' load in others_cpu_share")
    return p


def fit_line(x: Sequence[float], y: Sequence[float]) -> Dict[str, float]:
    """Least-squares ``y = c0 + c1 x`` (numpy.linalg.lstsq); one distinct x: ``c1 = 0``, ``c0 = mean``.
    Returns ``{"c0", "c1", "rmse"}`` (seconds, seconds per unit of x, seconds)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(set(x.tolist())) < 2:
        return {"c0": float(np.mean(y)), "c1": 0.0, "rmse": float(np.std(y))}
    a = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    rmse = float(np.sqrt(np.mean((a @ coef - y) ** 2)))
    return {"c0": float(coef[0]), "c1": float(coef[1]), "rmse": rmse}


def fit_shared_sum(samples: List[dict]) -> Optional[Dict[str, float]]:
    """``seconds = c_bytes x bytes + c_tensor x tensors`` by least squares through the origin (numpy);
    None without samples."""
    if not samples:
        return None
    a = np.array([[s["bytes"], s["tensors"]] for s in samples], float)
    y = np.array([s["seconds"] for s in samples])
    scale = a.max(axis=0)
    coef = np.linalg.lstsq(a / scale, y, rcond=None)[0] / scale
    return {"c_bytes": float(max(coef[0], 0.0)), "c_tensor": float(max(coef[1], 0.0)),
            "rmse": float(np.sqrt(np.mean((a @ coef - y) ** 2)))}


def fit_update_cold(in_step: List[dict]) -> Optional[Dict[str, Any]]:
    """``{"per_param_s", "samples", "method"}``: the extra seconds per parameter of the optimizer update
    as the runtime runs it (``update_in_step`` samples of :func:`measure_shared_sum`: right after the
    step's pipeline and gradient sums) over the same call repeated at once (``warm_seconds``, back to
    back as the ``update`` fit is timed): ``sum(seconds - warm_seconds) / sum(params)``, at least 0 (the
    update streams parameters, gradients and moments: what the pipeline evicted from the caches is
    fetched again, per byte). None without samples."""
    in_step = [s for s in in_step if s.get("params", 0) > 0 and "warm_seconds" in s]
    if not in_step:
        return None
    extra = sum(s["seconds"] - s["warm_seconds"] for s in in_step)
    return {"per_param_s": float(max(0.0, extra / sum(s["params"] for s in in_step))),
            "samples": len(in_step),
            "method": ("update seconds right after a step's pipeline and gradient sums (PipelineRuntime._run, "
                       "_reduce_shared, sq_norm, then _update_fn) minus the same call repeated at once, per "
                       "parameter (profile.measure_shared_sum)")}


def fit_update_runtime(in_step: List[dict], update: Optional[Mapping[str, float]]) -> Optional[Dict[str, Any]]:
    """``{"scale", "samples", "method"}``: the optimizer update as the runtime's own call runs it
    (``update_in_step`` samples of :func:`measure_shared_sum`, their ``warm_seconds``: the runtime's
    ``_update_fn`` -- under ZeRO-1 ``PipelineStage.owned_update`` of the owned names -- on the
    runtime's stages, repeated at once) over the ``update`` fit's seconds for the same parameters
    (``c0 + c1 x params``: :func:`measure_update`, ``PipelineStage.update`` of the four profiled stage
    kinds back to back): ``sum(warm_seconds) / sum(fit(params))``, at least 1e-3. None without samples
    or without the fit. Why (docs/benchmarks.md, issue 17, session 14): in the four quiet profiles of
    session 13 the runtime's calls ran 4.17-4.26 ns per parameter against the fit's 3.27-3.48."""
    in_step = [s for s in in_step if s.get("params", 0) > 0 and "warm_seconds" in s]
    if not in_step or not update:
        return None
    fit = sum(max(1e-12, float(update["c0"]) + float(update["c1"]) * s["params"]) for s in in_step)
    return {"scale": float(max(1e-3, sum(s["warm_seconds"] for s in in_step) / fit)),
            "samples": len(in_step),
            "method": ("the runtime's update call (PipelineRuntime._update_fn, repeated at once after a step: "
                       "warm_seconds of update_in_step, profile.measure_shared_sum) over the update fit "
                       "(PipelineStage.update of the profiled stage kinds, back to back) for the same parameters")}


def fit_compute(cfg: Any, samples: List[dict], seq_len: int, dp: int = 1) -> Dict[str, Dict[str, Dict[str, dict]]]:
    """Per TP degree and phase, the ``base``/``layer``/``embed``/``head`` lines, fitted JOINTLY by
    relative least squares (the sum of squared ``(fitted - measured) / measured``) over all stage samples of DP degree ``dp`` (``"dp"`` absent: 1), that TP degree and phase
    (``{"kind": "stage", "tp", "phase", "tokens" (per DP rank), "layers": n, "is_first", "is_last",
    "seconds"}``):

        seconds = base + n (layer_c0 + layer_c1 x layer_flops) + is_first (embed_c0 + embed_c1 x tokens)
                  + is_last (head_c0 + head_c1 x head_flops)

    (one regression instead of differences of noisy timings). ``rmse`` is the fit's, in seconds."""
    groups: Dict[tuple, List[dict]] = {}
    for s in samples:
        if s.get("kind") == "stage" and int(s.get("dp", 1)) == dp:
            groups.setdefault((int(s["tp"]), s["phase"]), []).append(s)
    out: Dict[str, Dict[str, Dict[str, dict]]] = {}
    for (tp, phase), rows in sorted(groups.items()):
        a = np.array([[1.0, r["layers"], r["layers"] * analytic.layer_flops(cfg, r["tokens"], seq_len),
                       float(r["is_first"]), r["is_first"] * r["tokens"], float(r["is_last"]),
                       r["is_last"] * analytic.head_flops(cfg, r["tokens"])] for r in rows])
        y = np.array([r["seconds"] for r in rows])
        # relative least squares (each row divided by its measured seconds): every call counts by its
        # RELATIVE error. Plain least squares in seconds let the largest calls set the line: with
        # microbatch sizes 1..64 profiled, the LM head's fitted intercept went to -51 ms and calls at
        # microbatch 1 were PREDICTED at a tenth of their measured time, which the planner then chose
        # (benchmarks/hetero_e2e.py: PREDICTED 1.2 s, measured 6.2 s; docs/benchmarks.md, issue 17)
        w = 1.0 / np.maximum(y, 1e-9)
        aw = a * w[:, None]
        scale = np.maximum(np.abs(aw).max(axis=0), 1e-30)  # column scaling for a well-conditioned solve
        coef = np.linalg.lstsq(aw / scale, np.ones_like(y), rcond=None)[0] / scale
        rmse = float(np.sqrt(np.mean((a @ coef - y) ** 2)))
        line = lambda c0, c1: {"c0": float(c0), "c1": float(c1), "rmse": rmse}
        out.setdefault(str(tp), {})[phase] = {
            "base": line(coef[0], 0.0), "layer": line(coef[1], coef[2]), "embed": line(coef[3], coef[4]),
            "head": line(coef[5], coef[6])}
    return out


#: statistic over the timed calls of one figure: "median" (default) or "min" (``--statistic``; the
#: minimum is closer to an unloaded machine's time when other jobs share the cores)
STATISTIC = {"name": "median"}


def _median_time(fn: Callable[[], Any], repeats: int, before: Optional[Callable[[], Any]] = None) -> float:
    """Seconds of ``fn()`` (which must block until its result is ready) after one untimed call: the
    median (or the minimum, see :data:`STATISTIC`) of ``repeats`` calls; ``before()`` runs untimed
    ahead of each call (fresh donated buffers)."""
    times = []
    for i in range(repeats + 1):
        arg = before() if before else None
        t0 = time.perf_counter()
        fn() if before is None else fn(arg)
        if i:
            times.append(time.perf_counter() - t0)
    return float(np.min(times) if STATISTIC["name"] == "min" else np.median(times))


# ---- measurements (JAX from here on) ---------------------------------------------------------------

def _stage_ranges(num_layers: int) -> Dict[str, tuple]:
    if num_layers < 4:
        raise ValueError(f"profiling needs a model with >= 4 layers (first, two middle, last stage), "
                         f"got {num_layers}")
    return {"first": (0, 0), "mid1": (1, 1), "mid2": (1, 2), "last": (num_layers - 1, num_layers - 1)}


def _inputs(st: Any, cfg: Any, mbs: int, seq_len: int):
    """Host arrays of one microbatch and the device input of a non-first stage, as the runtime has them."""
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (mbs, seq_len), dtype=np.int32)
    pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (mbs, seq_len))
    mask = np.ones((mbs, seq_len), np.float32)
    x_dev = None if st.is_first else st.place_input(
        rng.standard_normal((mbs, seq_len, cfg.hidden_size)).astype(jnp.dtype(cfg.dtype)))
    return tokens, pos, mask, x_dev


def measure_stage(st: Any, cfg: Any, mbs: int, seq_len: int, repeats: int) -> Dict[str, float]:
    """Median seconds of the runtime's four calls on stage ``st`` for one microbatch of ``mbs``
    samples, each with the host-input placement the runtime's F action does (runtime.py ``_StepExecutor._forward``).
    On the last stage ``B_recompute`` is the fused ``forward_backward`` (the same work)."""
    import jax
    import jax.numpy as jnp

    from hethub_jax.parallel.stage import StageInputs
    tokens, pos_h, mask, x_dev = _inputs(st, cfg, mbs, seq_len)

    def args():
        x = st.place_tokens(tokens) if st.is_first else x_dev
        extra = (st.place_tokens(tokens), st.place_tokens(mask)) if st.is_last else (None, None)
        return StageInputs(x, st.place_tokens(pos_h), *extra)

    g = jnp.ones((), jnp.float32) if st.is_last else jax.device_put(
        jnp.ones((mbs, seq_len, cfg.hidden_size), cfg.dtype), st.act_sharding)
    no = np.bool_(False)
    out = {"F": _median_time(lambda: jax.block_until_ready(st.forward_saving(st.params, args())[0]), repeats),
           "F_nosave": _median_time(lambda: jax.block_until_ready(st.forward(st.params, args())), repeats)}
    saved = st.forward_saving(st.params, args())[1]
    out["B"] = _median_time(lambda acc: jax.block_until_ready(st.backward_saved(saved, g, acc, no)[0]),
                            repeats, before=st.new_grad_buffer)
    if st.is_last:
        out["B_recompute"] = _median_time(
            lambda acc: jax.block_until_ready(st.forward_backward(st.params, args(), acc, no)), repeats,
            before=st.new_grad_buffer)
    else:
        acc = st.new_grad_buffer()
        out["B_recompute"] = _median_time(
            lambda: jax.block_until_ready(st.backward_recompute(st.params, args(), g, acc, no)[0]), repeats)
    return out


def measure_update(st: Any, repeats: int) -> float:
    """Median seconds of one optimizer update (``PipelineStage.update``) of the stage."""
    import jax
    import jax.numpy as jnp
    grads = st.new_grad_buffer()
    inv, norm = jnp.float32(1e-3), jnp.float32(1.0)

    def step():
        st.params, st.opt_state = st.update(st.params, st.opt_state, grads, inv, norm)
        jax.block_until_ready(st.params)
    return _median_time(step, repeats)


def measure_norm(st: Any, repeats: int) -> float:
    """Seconds of the stage's part of the global gradient norm as the runtime computes it
    (``PipelineStage.sq_norm`` of all its gradients, then the read of the scalar), back to back."""
    import jax.numpy as jnp
    grads, inv = st.new_grad_buffer(), jnp.float32(1e-3)
    return _median_time(lambda: float(st.sq_norm(grads, inv)), repeats)


def measure_host_copy(device: Any, sizes: Sequence[int], repeats: int) -> List[dict]:
    """Seconds of one device->host plus one host->device copy of ``n`` float32 bytes, halved."""
    import jax
    out = []
    for n in sizes:
        host = np.ones(n // 4, np.float32)
        dev = jax.device_put(host, device)

        def both():
            jax.device_get(dev).sum()
            jax.block_until_ready(jax.device_put(host, device))
        out.append({"kind": "host_copy", "bytes": n, "seconds": _median_time(both, repeats) / 2})
    return out


def measure_allreduce(devices: Sequence[Any], sizes: Sequence[int], repeats: int) -> List[dict]:
    """Seconds of a ``psum`` of ``n`` float32 bytes per device over ``devices`` (jit + shard_map)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    if len(devices) < 2:
        return []
    mesh = Mesh(np.asarray(devices), ("d",))
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older JAX
        from jax.experimental.shard_map import shard_map
    f = jax.jit(shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    out = []
    for n in sizes:
        x = jax.device_put(np.ones((len(devices), n // 4), np.float32), NamedSharding(mesh, P("d")))
        out.append({"kind": "allreduce", "bytes": n, "devices": len(devices),
                    "seconds": _median_time(lambda: jax.block_until_ready(f(x)), repeats)})
    return out


def measure_shared_sum(cfg: Any, devices: Sequence[Any], repeats: int, seq_len: int = 16) -> List[dict]:
    """The runtime's tail after the pipeline (``PipelineRuntime.train_step`` after ``_run``), call by
    call, in the state the runtime makes them: right after a step's pipeline (``PipelineRuntime._run``
    of a real step, which leaves its data in the CPU caches), on the gradients that pipeline
    accumulated, in the runtime's order. One process, one island, two plans: two pipeline stages
    sharing the tied embedding (tied models only; the layers split in half) and two data-parallel
    replicas of the whole model (every parameter shared). Per step (``repeats`` after one untimed
    step; each figure the :data:`STATISTIC` over steps):

    - ``{"kind": "shared_sum", "bytes", "tensors", "seconds"}``: ``_reduce_shared`` (host copies,
      float32 sums, placement back), with the float32 bytes and the number of tensors summed over
      the holders (the cost has a per-tensor part: one copy each way and one placement per tensor);
    - ``{"kind": "norm", "stage", "params", "seconds"}``: each stage's ``sq_norm`` of the gradients it
      counts in the global norm (``norm_owner``: a shared parameter's first holder) and the read of
      its scalar (``multiprocess.scalar``), ``params`` the counted parameters (a stage counting none
      runs no call and is not recorded);
    - ``{"kind": "update_in_step", "stage", "params", "seconds", "warm_seconds"}``: each stage's
      optimizer update (the runtime's ``_update_fn``, blocking; ``params``: the parameters it
      updates, under ZeRO-1 its replica's owned ones), and ``warm_seconds``: the same call repeated at
      once (back to back, as :func:`measure_update` times the update), in the same steps.

    Empty with fewer than 2 devices."""
    import math

    import jax
    import jax.numpy as jnp

    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel import multiprocess as mp
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.runtime import PipelineRuntime
    if len(devices) < 2:
        return []
    n, half = cfg.num_hidden_layers, cfg.num_hidden_layers // 2
    isl = [{"name": "p", "platform": devices[0].platform, "devices_per_process": 2}]
    plans = [{"islands": isl, "global_batch_size": 2, "microbatch_size": 1,
              "replicas": [{"stages": [{"island": "p", "first_layer": 0, "last_layer": n - 1}]}] * 2}]
    if cfg.tie_word_embeddings:
        plans.append({"islands": isl, "global_batch_size": 1, "microbatch_size": 1, "stages": [
            {"island": "p", "first_layer": 0, "last_layer": half - 1},
            {"island": "p", "first_layer": half, "last_layer": n - 1}]})
    stat = lambda xs: float(np.min(xs) if STATISTIC["name"] == "min" else np.median(xs))
    rng, out = np.random.default_rng(0), []
    for d in plans:
        plan = Plan.from_dict(d)
        rt = PipelineRuntime(plan, cfg, OptimConfig(), devices=list(devices[:2]))
        gbs = plan.global_batch_size
        batch = {"tokens": rng.integers(0, cfg.vocab_size, (gbs, seq_len), dtype=np.int32),
                 "targets": rng.integers(0, cfg.vocab_size, (gbs, seq_len), dtype=np.int32),
                 "loss_mask": np.ones((gbs, seq_len), np.float32)}
        inv = jnp.float32(1.0 / (gbs * seq_len))
        flats = {k: rt.stages[k].flat(rt.stages[k].params) for k in rt.local_keys}
        nbytes = sum(4 * flats[k][name].size for name, hs in rt.shared.items() for k in hs)
        tensors = sum(len(hs) for hs in rt.shared.values())
        times: Dict[tuple, List[float]] = {}
        counted_params: Dict[Any, int] = {}
        for i in range(repeats + 1):
            acc, _, _ = rt._run(batch, train=True)  # the pipeline: the state the tail starts in
            t0 = time.perf_counter()
            acc = jax.block_until_ready(rt._reduce_shared(acc))
            t = [("shared_sum", None, time.perf_counter() - t0)]
            sq = 0.0
            for k in rt.local_keys:
                st = rt.stages[k]
                counted = {m: v for m, v in st.flat(acc[k]).items() if rt.norm_owner[m] == k}
                if counted:
                    counted_params[k] = sum(int(v.size) for v in counted.values())
                    t0 = time.perf_counter()
                    sq += mp.scalar(st.sq_norm(counted, inv))
                    t.append(("norm", k, time.perf_counter() - t0))
            gnorm = jnp.float32(math.sqrt(sq))
            for k in rt.local_keys:
                st, t0 = rt.stages[k], time.perf_counter()
                st.params, st.opt_state = rt._update_fn(k)(st.params, st.opt_state, acc[k], inv, gnorm)
                jax.block_until_ready(st.params)
                t.append(("update_in_step", k, time.perf_counter() - t0))
            for k in rt.local_keys:  # the same call again at once (warm), paired with the one above
                st, t0 = rt.stages[k], time.perf_counter()
                st.params, st.opt_state = rt._update_fn(k)(st.params, st.opt_state, acc[k], inv, gnorm)
                jax.block_until_ready(st.params)
                t.append(("update_warm", k, time.perf_counter() - t0))
            if i:
                for kind, k, sec in t:
                    times.setdefault((kind, k), []).append(sec)
        for (kind, k), xs in times.items():
            if kind == "shared_sum":
                out.append({"kind": "shared_sum", "bytes": int(nbytes), "tensors": tensors, "seconds": stat(xs)})
                continue
            if kind == "update_warm":
                continue
            st = rt.stages[k]
            row = {"kind": kind, "stage": f"r{k[0]}s{k[1]} layers {st.first_layer}-{st.last_layer}",
                   "seconds": stat(xs)}
            if kind == "norm":
                row["params"] = counted_params[k]
            else:  # the parameters the call updates (under ZeRO-1 the replica's owned ones) and the warm call
                owned = rt.owned_names(k)
                row["params"] = int(sum(v.size for m, v in st.flat().items() if m in owned))
                row["warm_seconds"] = stat(times[("update_warm", k)])
            out.append(row)
    return out


def measure_shared_sum_mesh(cfg: Any, devices: Sequence[Any], meshes: Sequence[Tuple[int, int]], repeats: int,
                            seq_len: int = 16) -> List[dict]:
    """The runtime's gradient sums of the tied embedding (``PipelineRuntime._reduce_shared``: the host
    copies, the float32 sum, ``jnp.asarray`` and the ``device_put`` of every gradient leaf onto the
    stage's sharding) when the two stages that hold it are on a ``(dp, tp)`` mesh each, against the same
    plan on one device per stage, alternately in the same steps' state (right after a real step's
    pipeline, as :func:`measure_shared_sum`): on fake CPU devices the placement onto a 2-device sharding
    is not the one-device placement (session 12: 0.9 ms on one device, 2.7 ms on (1, 2), 1.6 ms on (2, 1)).

    One island of this process; per mesh of ``meshes`` other than ``(1, 1)`` that fits twice in
    ``devices``, a tied two-stage plan (the layers split in half) on that mesh and on ``(1, 1)``, one
    untimed step then ``repeats`` steps each, interleaved. Returns per mesh ``{"kind":
    "shared_sum_mesh", "dp", "tp", "seconds", "one_device_seconds"}`` (the :data:`STATISTIC` over the
    steps; the ratio scales :meth:`DeviceCosts.shared_sum_s` for stages on that mesh). Empty for an
    untied model or when no mesh fits."""
    import jax

    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.runtime import PipelineRuntime
    meshes = [tuple(m) for m in meshes if tuple(m) != (1, 1) and 2 * m[0] * m[1] <= len(devices)]
    if not cfg.tie_word_embeddings or not meshes or cfg.num_hidden_layers < 2:
        return []
    n, half = cfg.num_hidden_layers, cfg.num_hidden_layers // 2
    stat = lambda xs: float(np.min(xs) if STATISTIC["name"] == "min" else np.median(xs))
    rng, out = np.random.default_rng(0), []

    def runtime(dp: int, tp: int):
        isl = [{"name": "p", "platform": devices[0].platform, "devices_per_process": 2 * dp * tp}]
        gbs = 2 * dp  # one sample per DP rank and microbatch, 2 microbatches
        plan = Plan.from_dict({"islands": isl, "global_batch_size": gbs, "microbatch_size": dp, "stages": [
            {"island": "p", "first_layer": 0, "last_layer": half - 1, "dp": dp, "tp": tp},
            {"island": "p", "first_layer": half, "last_layer": n - 1, "dp": dp, "tp": tp}]})
        batch = {"tokens": rng.integers(0, cfg.vocab_size, (gbs, seq_len), dtype=np.int32),
                 "targets": rng.integers(0, cfg.vocab_size, (gbs, seq_len), dtype=np.int32),
                 "loss_mask": np.ones((gbs, seq_len), np.float32)}
        return PipelineRuntime(plan, cfg, OptimConfig(), devices=list(devices[:2 * dp * tp])), batch

    def once(rt, batch) -> float:
        acc, _, _ = rt._run(batch, train=True)  # the pipeline: the state the sums start in
        t0 = time.perf_counter()
        jax.block_until_ready(rt._reduce_shared(acc))
        return time.perf_counter() - t0
    one = runtime(1, 1)  # the reference, built (and compiled) once
    for dp, tp in meshes:
        pair = [runtime(dp, tp), one]
        times: List[List[float]] = [[], []]
        for i in range(max(1, repeats) + 1):
            for j, (rt, batch) in enumerate(pair):
                t = once(rt, batch)
                if i:
                    times[j].append(t)
        out.append({"kind": "shared_sum_mesh", "dp": dp, "tp": tp, "seconds": stat(times[0]),
                    "one_device_seconds": stat(times[1])})
    return out


def fit_shared_sum_mesh(samples: List[dict]) -> Dict[str, Dict[str, Any]]:
    """Per mesh ``"{dp}x{tp}"``: ``{"factor"}``, the summed seconds of the gradient sums with the
    stages on that mesh over the same plan's on one device per stage (:func:`measure_shared_sum_mesh`)."""
    by: Dict[str, List[dict]] = {}
    for x in samples:
        by.setdefault(f"{x['dp']}x{x['tp']}", []).append(x)
    return {m: {"factor": float(sum(x["seconds"] for x in xs) / sum(x["one_device_seconds"] for x in xs)),
                "method": "profile.measure_shared_sum_mesh: tied pp2 plan's _reduce_shared on the mesh over "
                          "on one device per stage, interleaved"}
            for m, xs in by.items() if sum(x["one_device_seconds"] for x in xs) > 0}


def measure_bridge(sizes: Sequence[int], repeats: int, spin_s: float = 0.05) -> Optional[List[dict]]:
    """Round trips over ``MPIHostBridge`` between ranks 0 and 1 (under ``mpiexec -n 2``), halved; None
    (with a message) when not under MPI with 2 ranks. ``spin_s``: the bridge's seconds of polling without
    sleeping before it backs off (``MPIHostBridge.with_spin``; the bridge's default 0.05): measure with the
    setting the islands run with (``benchmarks/predictor_accuracy.py --bridge-spin-s``)."""
    try:
        from mpi4py import MPI
    except ImportError:
        print("bridge: mpi4py not installed; skipped", flush=True)
        return None
    if MPI.COMM_WORLD.Get_size() != 2:
        print("bridge: not under `mpiexec -n 2`; the MPI bridge is skipped (run under mpiexec -n 2 to measure "
              "it); the in-process bridge (LocalCommunicator) is measured instead", flush=True)
        return None
    from hethub_jax.comm.mpi import MPIHostBridge
    comm = MPIHostBridge(MPI.COMM_WORLD).with_spin(spin_s)
    rank, out = comm.rank, []
    for n in sizes:
        buf = np.ones(max(1, n // 4), np.float32)

        def trip():
            if rank == 0:
                comm.send(buf, 1, 7)
                comm.recv(1, 8, out=buf)
            else:
                comm.recv(0, 7, out=buf)
                comm.send(buf, 0, 8)
        out.append({"kind": "bridge", "bytes": n, "seconds": _median_time(trip, repeats) / 2})
    return out


#: float32 bytes at which :func:`measure_bridge_allreduce` times the bridge's all-reduce: 4 KiB (the latency), 256
#: KiB and 4 MiB (the bandwidth; the tiny model's tied embedding, 32000 x 64 float32 = 8.2 MB, is summed over the
#: bridge every step); three sizes keep the measurement well under a second on this machine's bridge
BRIDGE_ALLREDUCE_SIZES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024)


def measure_bridge_allreduce(sizes: Sequence[int], repeats: int, spin_s: float = 0.05) -> Optional[List[dict]]:
    """Under ``mpiexec -n 2`` (both ranks call it): the MPI host bridge's all-reduce as training calls it for the
    shared gradients across islands (``PipelineRuntime._reduce_shared`` and the bucket thread:
    ``MPIHostBridge.allreduce_tree`` of a dict of float32 host arrays, op sum), at ``sizes`` bytes, both ranks
    entering together (after a blocking barrier), the bridge's waits polling without sleeping for ``spin_s`` (as
    :func:`measure_bridge`); per size the median over ``repeats`` (one untimed call first) of the SLOWER rank's
    wall seconds (an MPI max). The method of ``benchmarks/predictor_accuracy.py``'s ``bridge_allreduce_samples``
    (session 15), which found the all-reduce 6.6x one transfer of the same bytes, so a fit of its own
    (:func:`fit_bridge_allreduce`) rather than the ring formula over the ping-pong line.

    Returns:
      ``[{"kind": "bridge_allreduce", "bytes", "seconds"}, ...]`` on both ranks; None (with a message) when not
      under MPI with 2 ranks.
    """
    try:
        from mpi4py import MPI
    except ImportError:
        print("bridge all-reduce: mpi4py not installed; skipped", flush=True)
        return None
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        print("bridge all-reduce: not under `mpiexec -n 2`; skipped", flush=True)
        return None
    from hethub_jax.comm.mpi import MPIHostBridge
    br = MPIHostBridge(world.Dup(), timeout=120).with_spin(spin_s)
    out = []
    for n in sizes:
        x = {"g": np.ones(max(1, int(n) // 4), np.float32)}
        times = []
        for i in range(repeats + 1):
            world.Barrier()
            t0 = time.perf_counter()
            br.allreduce_tree(x, op="sum")
            dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i:
                times.append(dt)
        out.append({"kind": "bridge_allreduce", "bytes": int(x["g"].nbytes), "seconds": float(np.median(times))})
    return out


def fit_bridge_allreduce(samples: Sequence[dict]) -> Optional[Dict[str, Any]]:
    """``fits.bridge_allreduce``: seconds of the bridge's all-reduce of ``x`` bytes as ``c0 + c1 x`` (alpha and
    1 / beta; ``planner.costs.DeviceCosts.bridge_allreduce_fit`` reads it), fitted as Hockney's alpha-beta model
    is usually estimated (R. W. Hockney, "The communication challenge for MPP", Parallel Computing 20, 1994):
    ``c1`` the slope between the two LARGEST sizes (the bandwidth regime, where the shared gradients are: the
    tiny model's tied embedding is 8.2 MB), ``c0`` the smallest size's seconds less ``c1 x`` its bytes (the
    latency). Not least squares over all sizes: this bridge's all-reduce is convex in the bytes (measured
    68 us at 4 KiB, 80 us at 256 KiB, 3.1 ms at 4 MiB, LOADED machine, 2026-12-03), where least squares gives a
    negative intercept and under-predicts the large sizes. Both coefficients are kept >= 0: a slope <= 0 (noise,
    fewer than two sizes) gives the flat mean, an intercept < 0 gives 0. None without samples (not under
    ``mpiexec -n 2``)."""
    if not samples:
        return None
    pts = sorted((float(s["bytes"]), float(s["seconds"])) for s in samples)
    (x0, y0), c1 = pts[0], 0.0
    if len(pts) >= 2 and pts[-1][0] > pts[-2][0]:
        (xa, ya), (xb, yb) = pts[-2], pts[-1]
        c1 = max(0.0, (yb - ya) / (xb - xa))
    c0 = max(0.0, y0 - c1 * x0) if c1 > 0 else float(np.mean([y for _, y in pts]))
    x, y = np.asarray([p[0] for p in pts]), np.asarray([p[1] for p in pts])
    rmse = float(np.sqrt(np.mean((c0 + c1 * x - y) ** 2)))
    return {"c0": c0, "c1": c1, "rmse": rmse,
            "method": "profile.measure_bridge_allreduce: MPIHostBridge.allreduce_tree of float32 host arrays between "
                      "the 2 ranks, the slower rank's seconds, median; c1 the slope between the two largest sizes, "
                      "c0 the smallest size's seconds less c1 x its bytes (Hockney's alpha-beta)"}


def _progress_bar(total: int, progress: bool) -> Any:
    """The profiler's progress bar over ``total`` stage settings: tqdm's redrawn bar on a terminal, plain
    lines every 15 s otherwise (a log file, ``mpiexec``'s pipes: no carriage returns; the training
    loop's `train_hooks.PlainLinesBar`); disabled when ``progress`` is false."""
    from tqdm import tqdm
    if sys.stderr.isatty() or not progress:
        return tqdm(total=total, desc="profile", disable=not progress, unit="stage")
    from hethub_jax.train_hooks import PlainLinesBar
    return PlainLinesBar(total=total, desc="profile", unit="stage", file=sys.stderr, mininterval=15, miniters=1,
                         leave=False, bar_format="{desc}: {n_fmt}/{total_fmt} stage settings ({percentage:.0f}%), ETA {remaining}"
                                    "{postfix}")


def progress_setting(dp: int, tp: int, kind: str, mbs: int) -> str:
    """The stage setting :func:`profile_compute` is measuring, for its progress line: the ``(dp, tp)`` mesh,
    the stage kind and the microbatch in samples, in total and, on a DP mesh, per DP rank, e.g.
    ``"mesh 2x1 (dp x tp), first stage, microbatch 4 = 2 per DP rank x 2"``; ``kind``: a key of
    :func:`_stage_ranges`; ``mbs``: samples per DP rank."""
    stage = _STAGE_WORDS.get(kind, f"{kind} stage")
    total = f"microbatch {mbs * dp}" + (f" = {mbs} per DP rank x {dp}" if dp > 1 else "")
    return f"mesh {dp}x{tp} (dp x tp), {stage}, {total}"


#: the stage kinds of :func:`_stage_ranges` in words (progress lines)
_STAGE_WORDS = {"first": "first stage", "mid1": "middle stage of 1 layer", "mid2": "middle stage of 2 layers",
                "last": "last stage"}


def profile_compute(cfg: Any, seq_len: int, mbs_list: Sequence[int], tps: Sequence[int], repeats: int,
                    devices: Sequence[Any], progress: bool, dps: Sequence[int] = (1,),
                    dp_mbs_list: Optional[Sequence[int]] = None) -> tuple:
    """(stage samples, update samples) over the stage meshes -- ``(1, tp)`` for every TP degree and
    ``(dp, 1)`` for every DP degree > 1 -- stage kinds and microbatch sizes (per DP rank: a ``(dp, 1)``
    mesh runs ``dp x`` each microbatch size, so that its samples have the same tokens per rank; the
    sizes of the ``(dp, 1)`` meshes are ``dp_mbs_list`` when given, else ``mbs_list``)."""
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    ranges = _stage_ranges(cfg.num_hidden_layers)
    tx = make_optimizer(OptimConfig())
    meshes = [(1, tp) for tp in tps] + [(dp, 1) for dp in dps if dp > 1]
    sizes_of = lambda dp: list(mbs_list if dp == 1 or dp_mbs_list is None else dp_mbs_list)
    samples, updates = [], []
    bar = _progress_bar(len(ranges) * sum(len(sizes_of(dp)) for dp, _ in meshes), progress)
    for dp, tp in meshes:
        if dp * tp > len(devices):
            raise ValueError(f"a {dp}x{tp} (dp x tp) mesh needs {dp * tp} devices; the island has {len(devices)} "
                             f"(for CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
        for kind, (fl, ll) in ranges.items():
            st = PipelineStage(cfg, fl, ll, list(devices[:dp * tp]), dp, tp, seed=0, recompute=False, optimizer=tx)
            for mbs in sizes_of(dp):
                bar.set_postfix_str(progress_setting(dp, tp, kind, mbs), refresh=False)
                for phase, sec in measure_stage(st, cfg, mbs * dp, seq_len, repeats).items():
                    samples.append({"kind": "stage", "stage": kind, "first_layer": fl, "last_layer": ll,
                                    "layers": ll - fl + 1, "is_first": st.is_first, "is_last": st.is_last,
                                    "dp": dp, "tp": tp, "phase": phase, "microbatch_size": mbs * dp,
                                    "tokens": mbs * seq_len, "seconds": sec})
                bar.update()
                if bar.n == bar.total and getattr(bar, "last_print_n", bar.n) != bar.n:
                    bar.refresh()  # lines mode: the 100 % line once (leave=False: close draws nothing)
            # the update and the norm on every mesh: on fake CPU devices sharing the host's cores a
            # (1, tp) mesh's update is not one device's at 1/tp of the parameters (docs/benchmarks.md)
            n = analytic.stage_params_per_device(cfg, fl, ll, fl == 0, ll == cfg.num_hidden_layers - 1, tp)
            updates.append({"kind": "update", "stage": kind, "dp": dp, "tp": tp, "params": n,
                            "seconds": measure_update(st, repeats)})
            if (dp, tp) != (1, 1):
                updates.append({"kind": "norm_mesh", "stage": kind, "dp": dp, "tp": tp, "params": n,
                                "seconds": measure_norm(st, repeats)})
    bar.close()
    return samples, updates


def parse_stage_shapes(text: str, num_layers: int) -> List[tuple]:
    """``"0-7,0-3"`` -> ``[(0, 7), (0, 3)]``: layer ranges FIRST-LAST (inclusive) of stages to measure
    whole (:func:`profile_stage_shapes`); "" -> [].

    Raises:
      ValueError: for a malformed range, ``FIRST > LAST`` or a layer outside ``0..num_layers-1``.
    """
    out = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            a, b = (int(v) for v in part.split("-"))
        except ValueError:
            raise ValueError(f"stage shape {part!r}: expected FIRST-LAST layer indices, e.g. 0-{num_layers - 1}") from None
        if not 0 <= a <= b < num_layers:
            raise ValueError(f"stage shape {part!r}: need 0 <= FIRST <= LAST <= {num_layers - 1}")
        out.append((a, b))
    return list(dict.fromkeys(out))


def profile_stage_shapes(cfg: Any, seq_len: int, mbs_list: Sequence[int], tps: Sequence[int], repeats: int,
                         devices: Sequence[Any], shapes: Sequence[tuple]) -> List[dict]:
    """Whole-stage samples of the layer ranges ``shapes`` (``(first, last)``, inclusive) on ``(1, tp)``
    meshes at every microbatch size of ``mbs_list``: the runtime's four calls (:func:`measure_stage`),
    one ``{"kind": "stage_shape", "first_layer", "last_layer", "layers", "is_first", "is_last", "dp": 1,
    "tp", "phase", "microbatch_size", "tokens", "seconds"}`` each.

    Why: the compute fits (:func:`fit_compute`) add one layer's fitted seconds per layer of a stage,
    measured on stages of one and two layers; on a CPU core a call's seconds per layer rise with the
    layers it holds (its saved activations outgrow the core's caches: at microbatch 16 x 64 tokens of
    the 15 M model of ``benchmarks/hetero_e2e.py`` two layers took 2.1-2.3x one layer's seconds, and
    the whole 8-layer model's fused forward + backward 1.41 s in training against 1.26-1.31 s from the
    fits; docs/benchmarks.md, issue 17). A stage of a measured shape is then predicted from these
    seconds (``planner.costs.DeviceCosts.measured_stage_s``), not from the fits. Kind ``stage_shape``
    keeps them out of the fits."""
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    tx, L, out = make_optimizer(OptimConfig()), cfg.num_hidden_layers, []
    for tp in tps:
        if tp > len(devices):
            raise ValueError(f"TP {tp} needs {tp} devices; the island has {len(devices)}")
        for fl, ll in shapes:
            st = PipelineStage(cfg, fl, ll, list(devices[:tp]), 1, tp, seed=0, recompute=False, optimizer=tx)
            for mbs in mbs_list:
                for phase, sec in measure_stage(st, cfg, mbs, seq_len, repeats).items():
                    out.append({"kind": "stage_shape", "first_layer": fl, "last_layer": ll, "layers": ll - fl + 1,
                                "is_first": fl == 0, "is_last": ll == L - 1, "dp": 1, "tp": tp, "phase": phase,
                                "microbatch_size": mbs, "tokens": mbs * seq_len, "seconds": sec})
    return out


#: the largest microbatch size at which :func:`measure_chunked_last` times the chunked last microbatch by
#: default (heterogeneous DP's planned microbatches on this machine: 4 and 8 in the recorded runs)
CHUNKED_MAX_MBS = 16


def chunked_microbatch_sizes(spec: str, mbs_list: Sequence[int], whole_model_shape: bool) -> List[int]:
    """The microbatch sizes ``--chunked-mbs`` asks :func:`measure_chunked_last` for: ``"none"``: [];
    ``"auto"``: the profiled sizes ``mbs_list`` up to :data:`CHUNKED_MAX_MBS` (the smallest when none is)
    when the whole model is one of ``--stage-shapes`` (``whole_model_shape``), else []; otherwise the
    comma-separated sizes given, ascending (measured whether or not the whole model is a stage shape:
    plan-less training asks for them, ``hethub_jax.train_predict.chunked_microbatch_sizes_to_profile``).

    Raises:
      SystemExit: for a size that is not an integer >= 1."""
    spec = spec.strip().lower()
    if spec == "none":
        return []
    if spec == "auto":
        return ([m for m in mbs_list if m <= CHUNKED_MAX_MBS] or [min(mbs_list)]) if whole_model_shape else []
    try:
        sizes = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--chunked-mbs must be auto, none or comma-separated microbatch sizes, got {spec!r}") from None
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"--chunked-mbs sizes must be >= 1, got {spec!r}")
    return sizes


def measure_chunked_last(cfg: Any, devices: Sequence[Any], seq_len: int, mbs_list: Sequence[int], repeats: int,
                         bucket_mb: float = 25.0) -> List[dict]:
    """The bucketed all-reduce's chunked last microbatch against the fused one (issue 17, session 15): on the
    whole-model stage (every heterogeneous-DP replica's shape), per microbatch size, interleaved call by call
    (so a drift of the machine's speed hits all three alike), median seconds of
      * ``fused``: ``PipelineStage.forward_backward`` (the unbucketed path's last microbatch, and every
        microbatch of a one-microbatch replica: ``plan.chunks_last_microbatch``),
      * ``chunked``: ``buckets.StageChunks.forward_backward`` at ``bucket_mb`` (first bucket 1 MiB, as
        ``PipelineRuntime.set_grad_buckets``) with a no-op hand-over: its programs only (one jit per bucket,
        the layers' ``jax.vjp`` residuals leaving the jit),
      * ``chunked_copies``: the same with each bucket's gradients copied to the host as float32 on a
        background thread of this process (what the runtime's bucket thread does before its all-reduce,
        ``buckets.BucketedReduction.ready``), joined at the end: on a CPU island that thread shares the core.
    One ``{"kind": "chunked_last", "microbatch_size", "tokens", "num_buckets", "fused_seconds", "seconds",
    "copies_seconds"}`` per size; :func:`fit_chunked_last` turns them into the predictor's ratio
    (``hethub_jax.planner.predict_buckets.chunked_last_ratio``). Cost: 3 x (``repeats`` + 1) whole-model F+B
    calls per size, plus compiling the fused program and each bucket's (README's main command's model, tiny at
    sequence 128, sizes 1 and 16, 2 repeats: 24-26 s of CPU on a shared machine, session 16).

    Memory (issue 17, session 16, docs/benchmarks.md): under the steady host allocator (one glibc arena, no
    mmap) the heap keeps every page the earlier phases touched, and this phase's blocks did not fit into its
    free holes: after the whole-model stage shapes it added 0.7 GB resident (the 15 M model at sizes
    1-16) to 1.5-2 GB (at the batch-64 sizes, session 15). So it first gives the free pages back
    (:func:`release_host_memory`), drops each finished size's compiled programs, and gives the pages back
    again at its end: its own pages then stay under the earlier phases' peak (measured: +45 MiB over it at
    sizes 1-16, nothing at the batch-64 sizes: 8.85 GB peak with it)."""
    import jax
    import jax.numpy as jnp
    from concurrent.futures import ThreadPoolExecutor

    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel import buckets as bk
    from hethub_jax.parallel.stage import PipelineStage, StageInputs
    L = cfg.num_hidden_layers
    release_host_memory()  # the earlier phases' free heap pages: this one's blocks are placed afresh
    st = PipelineStage(cfg, 0, L - 1, list(devices[:1]), 1, 1, seed=0, recompute=False,
                       optimizer=make_optimizer(OptimConfig()))
    cap = max(1, int(bucket_mb * 2**20))
    chunks = bk.StageChunks(st, cap, min(bk.DEFAULT_FIRST_BUCKET_BYTES, cap))
    no, out = np.bool_(True), []
    pool = ThreadPoolExecutor(1, thread_name_prefix="profile-bucket-copies")
    try:
        for mbs in mbs_list:
            tokens, pos_h, mask, _ = _inputs(st, cfg, mbs, seq_len)

            def args():
                return StageInputs(st.place_tokens(tokens), st.place_tokens(pos_h), st.place_tokens(tokens),
                                   st.place_tokens(mask))

            def fused():
                jax.block_until_ready(st.forward_backward(st.params, args(), st.new_grad_buffer(), no))

            def chunked(copies: bool):
                futs = []

                def ready(_chunk, flat, _raw):
                    if copies:
                        futs.append(pool.submit(lambda f=flat: [np.asarray(v, np.float32) for v in f.values()]))
                loss, acc = chunks.forward_backward(args(), st.new_grad_buffer(), no,
                                                    lambda x, m: jax.block_until_ready(x), ready)
                jax.block_until_ready((loss, acc))
                for f in futs:
                    f.result()
            calls = {"fused": fused, "chunked": lambda: chunked(False), "copies": lambda: chunked(True)}
            times: Dict[str, List[float]] = {k: [] for k in calls}
            for i in range(repeats + 1):
                for k, fn in (list(calls.items())[i % 3:] + list(calls.items())[:i % 3]):
                    t0 = time.perf_counter()
                    fn()
                    if i:
                        times[k].append(time.perf_counter() - t0)
            stat = np.min if STATISTIC["name"] == "min" else np.median
            out.append({"kind": "chunked_last", "microbatch_size": mbs, "tokens": mbs * seq_len,
                        "num_buckets": len(chunks.chunks), "bucket_mb": float(bucket_mb),
                        "fused_seconds": float(stat(times["fused"])), "seconds": float(stat(times["chunked"])),
                        "copies_seconds": float(stat(times["copies"]))})
            del times, calls
            jax.clear_caches()  # this size's programs (fused and per bucket) are not called again
    finally:
        pool.shutdown()
    del jnp, chunks, st
    release_host_memory()
    return out


def release_host_memory() -> Dict[str, Any]:
    """Between the profiler's phases: drops unreachable Python objects (``gc.collect``), JAX's compiled
    programs (``jax.clear_caches``: a later phase compiles its own) and gives the heap's free pages back to
    the kernel (``host_allocator.release_free_host_memory``, glibc ``malloc_trim``). Under the steady host
    allocator the process otherwise keeps every page it ever touched resident (issue 17, session 16:
    docs/benchmarks.md). Returns ``{"rss_bytes_before", "rss_bytes_after"}`` (``/proc/self/statm``; None
    where unreadable). Never call it inside a timed loop: the next calls fault the pages in again."""
    import gc

    import jax

    from hethub_jax.host_allocator import release_free_host_memory
    before = _rss_bytes()
    gc.collect()
    jax.clear_caches()
    release_free_host_memory()
    return {"rss_bytes_before": before, "rss_bytes_after": _rss_bytes()}


def _rss_bytes() -> Optional[int]:
    """This process's resident set size in bytes (``/proc/self/statm``), None where unreadable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_status() -> Dict[str, Optional[int]]:
    """This process's memory now: ``{"rss_bytes": resident (VmRSS), "peak_rss_bytes": the peak resident set
    since the process started (VmHWM)}`` from ``/proc/self/status`` (kB there); where that is unreadable the
    peak from ``resource.getrusage`` (``ru_maxrss``, KiB on Linux) and the resident set from
    ``/proc/self/statm``, each None when unknown. Never resets the peak (``/proc/self/clear_refs`` would also
    lower what ``/usr/bin/time -v`` reports for the whole process)."""
    out: Dict[str, Optional[int]] = {"rss_bytes": None, "peak_rss_bytes": None}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = {"VmRSS:": "rss_bytes", "VmHWM:": "peak_rss_bytes"}.get(line.split(":")[0] + ":")
                if key:
                    out[key] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if out["peak_rss_bytes"] is None:
        try:
            import resource
            out["peak_rss_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except (ImportError, OSError, ValueError):
            pass
    if out["rss_bytes"] is None:
        out["rss_bytes"] = _rss_bytes()
    return out


class PhaseLog:
    """Per-phase wall seconds and this process's memory, for the profiler's phases (``profile.main``: the
    JSON's ``phases``) and ``benchmarks/hetero_e2e.py``'s ranks (issue 17, session 17: a quiet run's peak
    rose from 9.99 to 14.97 GB and nobody could say in which phase). Each phase (``with log.phase(name):``)
    appends ``{"phase", "seconds" (wall), "peak_rss_bytes" (VmHWM at its end: the process's peak so far),
    "peak_rss_rise_bytes" (how much this phase raised that peak; 0: it stayed under an earlier phase's),
    "rss_bytes" (resident at its end), "rss_bytes_before"}`` (bytes; None where unreadable). A phase that
    raises an exception is not recorded. ``say``: called with :func:`phase_line` of each record (None:
    silent)."""

    def __init__(self, say: Optional[Callable[[str], Any]] = None):
        self.phases: List[Dict[str, Any]] = []
        self._say = say
        self._peak: Optional[int] = None  # the highest peak read so far (bytes)

    @contextlib.contextmanager
    def phase(self, name: str):
        before, t0 = memory_status(), time.perf_counter()
        yield
        after = memory_status()
        peak, rise = after["peak_rss_bytes"], None
        if before["peak_rss_bytes"] is not None and peak is not None:
            # the kernel syncs threads' RSS counters lazily: a later VmHWM can read a few pages LOWER than an
            # earlier one (seen: 64 KiB); the peak never falls, so the highest reading so far is the peak
            start = max(before["peak_rss_bytes"], self._peak or 0)
            peak = max(peak, start)
            rise = peak - start
        self._peak = peak if peak is not None else self._peak
        rec = {"phase": name, "seconds": time.perf_counter() - t0, "peak_rss_bytes": peak,
               "peak_rss_rise_bytes": rise, "rss_bytes": after["rss_bytes"], "rss_bytes_before": before["rss_bytes"]}
        self.phases.append(rec)
        if self._say is not None:
            self._say(phase_line(rec))


def phase_line(rec: Mapping[str, Any]) -> str:
    """One progress line for a :class:`PhaseLog` record: ``phase NAME: S s, peak RSS X GiB (+R GiB), resident
    Y GiB`` (``?`` where unknown)."""
    gib = lambda b: "?" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    rise = rec.get("peak_rss_rise_bytes")
    return (f"phase {rec['phase']}: {rec['seconds']:.1f} s, peak RSS {gib(rec.get('peak_rss_bytes'))} GiB"
            + ("" if rise is None else f" (+{rise / 2**30:.2f} GiB in this phase)")
            + f", resident {gib(rec.get('rss_bytes'))} GiB")


def fit_chunked_last(samples: List[dict]) -> Optional[Dict[str, Any]]:
    """``{"points": [[tokens, chunked / fused], ...], "copies_points": [[tokens, chunked_copies / fused],
    ...]}`` from :func:`measure_chunked_last`'s samples (None without any): the MEASURED ratio the predictor
    multiplies a chunked replica's last fused F+B by (``predict_buckets.chunked_last_ratio``). The copies
    ratio is recorded for comparison with the predictor's separate term for the host work on the core
    (``DeviceCosts.shared_sum_s``), not used by it."""
    pts = [s for s in samples if s.get("fused_seconds", 0) > 0]
    if not pts:
        return None
    pts.sort(key=lambda s: s["tokens"])
    return {"points": [[s["tokens"], s["seconds"] / s["fused_seconds"]] for s in pts],
            "copies_points": [[s["tokens"], s["copies_seconds"] / s["fused_seconds"]] for s in pts],
            "source": "measure_chunked_last: StageChunks.forward_backward over PipelineStage.forward_backward, "
                      "whole-model stage, interleaved"}


class _NeighbourProcess:
    """A co-run neighbour in a PROCESS of its own (:func:`measure_corun` with ``neighbour="process"``), as islands
    run under mpiexec: a child Python (``python -m hethub_jax.profile --corun-child CONFIG_JSON SEQ``) with its own
    JAX, the steady host allocator (as the runtime sets it) and the same XLA flags, building the neighbour stages on
    its first device: ``"L"`` another last stage's fused forward + backward, ``"F"`` / ``"B"`` another first stage's
    forward / backward, each on a placed one-sample microbatch (:func:`_corun_child`). :meth:`call` returns a
    blocking function that runs one of them and waits for its end (a pipe; calls are serialised by a lock, so the
    timed-alone and looping uses never interleave)."""

    def __init__(self, cfg: Any, seq_len: int, core: Optional[int] = None):
        import subprocess
        import threading
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")] if p))
        self._p = subprocess.Popen([sys.executable, "-m", "hethub_jax.profile", "--corun-child",
                                    json.dumps(cfg.to_dict()), str(seq_len), "" if core is None else str(core)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._lock = threading.Lock()
        if self._p.stdout.read(1) != b"r":
            raise RuntimeError(f"the co-run neighbour process did not start (exit status {self._p.poll()})")

    def call(self, what: bytes) -> Callable[[], None]:
        def run() -> None:
            with self._lock:
                self._p.stdin.write(what)
                self._p.stdin.flush()
                if self._p.stdout.read(1) != b"d":
                    raise RuntimeError("the co-run neighbour process stopped")
        return run

    def close(self) -> None:
        try:
            self._p.stdin.write(b"q")
            self._p.stdin.close()
        except OSError:
            pass
        self._p.wait(60)


def _corun_child(config_json: str, seq_len: str, core: str = "") -> None:
    """The neighbour process of :class:`_NeighbourProcess`: answers ``r`` when its calls are compiled, then runs
    ``L`` / ``F`` / ``B`` and answers ``d`` each, until ``q`` or end of input. Its own prints go to stderr.
    ``core``: the core id it pins itself to before JAX starts (``--pin``), ``""``: unpinned."""
    if core:
        from hethub_jax.core_pinning import pin_threads
        pin_threads([int(core)])
    from hethub_jax.host_allocator import steady_host_allocator
    steady_host_allocator()  # before the JAX backend's threads, as the runtime sets it for CPU islands
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    import jax

    from hethub_jax.models.config import LlamaConfig
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    cfg, seq = LlamaConfig(**json.loads(config_json)), int(seq_len)
    tx, L, dev = make_optimizer(OptimConfig()), cfg.num_hidden_layers, jax.devices()[0]
    last = PipelineStage(cfg, L - 1, L - 1, [dev], 1, 1, seed=0, recompute=False, optimizer=tx)
    first = PipelineStage(cfg, 0, 0, [dev], 1, 1, seed=0, recompute=False, optimizer=tx)
    calls = {b"L": _stage_call(last, cfg, seq, "B_recompute", placed_once=True),
             b"F": _stage_call(first, cfg, seq, "F", placed_once=True),
             b"B": _stage_call(first, cfg, seq, "B", placed_once=True)}
    for f in calls.values():
        f()
    out.write(b"r")
    out.flush()
    while True:
        c = sys.stdin.buffer.read(1)
        if not c or c == b"q":
            return
        calls[c]()
        out.write(b"d")
        out.flush()


def measure_corun(cfg: Any, devices: Sequence[Any], seq_len: int, repeats: int,
                  neighbour: str = "thread", neighbour_core: Optional[int] = None) -> List[dict]:
    """The slowdown of this device type's stage calls while a second island of the same process
    computes on other devices, per pair of call sizes: on CPU, islands run as threads (or processes)
    of one host share its cores, memory bandwidth and XLA's thread pool, which a one-island profile
    does not see, and a call beside a much larger one is slowed differently from a call beside a
    smaller one (docs/benchmarks.md issue 13: in a two-island pipeline the last stage's fused F+B ran
    about as fast as alone beside the first stage's small calls, which lost 1.4-3.8x).

    A first stage (layer 0) and a last stage (last layer) on ``devices[0]``. Two neighbours on
    ``devices[1]``, run by a second thread: a LARGE one (another last stage's fused forward + backward),
    started together with each timed call (as a pipeline's first stage starts its next F, or its B,
    when the last stage starts its fused F+B: a call beside a looping neighbour at a random phase was
    hardly slowed, 0.92 / 1.10x on the quiet machine, against 1.4-3.2x in the pipeline; beside one
    started with it 1.15-1.8x F and 1.8-2.6x B under load (3 interleaved runs), docs/benchmarks.md issue 13), beside
    which the first stage's F and B, the last stage's fused F+B and its update are timed; and a SMALL
    one (another first stage's F then B) in a loop, beside which the last stage's fused F+B is timed
    (covered by the loop from start to end). Each call is timed alternately alone and beside the busy
    neighbour, ``repeats`` times each (after a compiling call), and the neighbour's calls alone in
    the same alternation (the main thread, while the loop is idle). Returns one ``{"kind": "corun", "call",
    "alone_s", "busy_s", "neighbour", "neighbour_s"}`` per (call, neighbour): medians of each;
    ``neighbour`` ``"large"`` or ``"small"``, ``neighbour_s`` the neighbour's seconds per call alone
    (the median; the small neighbour's F and B averaged), so that ``alone_s / neighbour_s`` is the
    pair's size ratio (:func:`fit_corun`). Empty with fewer than 2 devices.

    ``neighbour``: ``"thread"`` (the default: the neighbours computed by a second thread of this process, on
    ``devices[1]``) or ``"process"`` (computed by a process of its own, :class:`_NeighbourProcess`, started and
    stopped here: islands that are processes, as under mpiexec, share the cores but not this process's allocator
    lock nor its XLA runtime; docs/benchmarks.md issue 13, session 13: small calls beside a thread 1.7-2.3x, beside a
    process 1.3-1.5x, nearly quiet). The samples then carry ``"neighbour_kind": "process"``.
    ``neighbour_core``: the core the neighbour process pins itself to (``--pin``: this process pinned to another
    one; the samples then carry ``"pinned": true``), None: unpinned.

    Raises:
      ValueError: for another ``neighbour``, or a ``neighbour_core`` with a thread neighbour.
    """
    import threading

    import jax

    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    if neighbour_core is not None and neighbour != "process":
        raise ValueError("a pinned co-run neighbour (neighbour_core) must be a process: a thread shares this "
                         "process's pinned core")
    if len(devices) < 2:
        return []
    tx, L = make_optimizer(OptimConfig()), cfg.num_hidden_layers
    mk = lambda fl, ll, d: PipelineStage(cfg, fl, ll, [d], 1, 1, seed=0, recompute=False, optimizer=tx)
    first, last = mk(0, 0, devices[0]), mk(L - 1, L - 1, devices[0])
    other_last, other_first = mk(L - 1, L - 1, devices[1]), mk(0, 0, devices[1])
    calls = {"first_F": _stage_call(first, cfg, seq_len, "F"), "first_B": _stage_call(first, cfg, seq_len, "B"),
             "last_FB": _stage_call(last, cfg, seq_len, "B_recompute"),
             "last_update": lambda: _update_once(last)}
    if neighbour not in ("thread", "process"):
        raise ValueError(f"neighbour must be 'thread' or 'process', got {neighbour!r}")
    proc = _NeighbourProcess(cfg, seq_len, neighbour_core) if neighbour == "process" else None
    if proc is None:
        small_f = _stage_call(other_first, cfg, seq_len, "F", placed_once=True)
        small_b = _stage_call(other_first, cfg, seq_len, "B", placed_once=True)
        large = _stage_call(other_last, cfg, seq_len, "B_recompute", placed_once=True)
    else:
        small_f, small_b, large = proc.call(b"F"), proc.call(b"B"), proc.call(b"L")
    neighbours = {"large": ([large], calls), "small": ([small_f, small_b], {"last_FB": calls["last_FB"]})}
    out: List[dict] = []
    for fn in calls.values():
        fn()
    for kind, (nb, timed) in neighbours.items():
        for f in nb:
            f()
        alone_n: Dict[int, List[float]] = {}
        busy, stop, go, done = threading.Event(), threading.Event(), threading.Event(), threading.Event()
        aligned = kind == "large"  # the large neighbour starts when the timed call starts, as in a pipeline

        def loop(nb=nb, busy=busy, stop=stop, go=go, done=done, aligned=aligned):
            while not stop.is_set():
                if aligned:
                    if go.wait(0.01):
                        go.clear()
                        for f in nb:
                            f()
                        done.set()
                elif busy.wait(0.01):
                    for f in nb:
                        f()
        th = threading.Thread(target=loop, daemon=True)
        th.start()
        times: Dict[tuple, List[float]] = {}
        try:
            for i in range(2 * repeats):
                (busy.set if i % 2 and not aligned else busy.clear)()
                time.sleep(0.005)
                for name, fn in timed.items():
                    if aligned and i % 2:
                        done.clear()
                        go.set()
                    t0 = time.perf_counter()
                    fn()
                    times.setdefault((name, i % 2), []).append(time.perf_counter() - t0)
                    if aligned and i % 2:
                        done.wait(5.0)  # the neighbour's call has ended: the next starts with the next call
                for j, f in enumerate(nb if not i % 2 else ()):  # the neighbour's calls alone, interleaved
                    t0 = time.perf_counter()
                    f()
                    alone_n.setdefault(j, []).append(time.perf_counter() - t0)
        finally:
            stop.set()
            busy.clear()
            go.set()
            th.join()
        # the median whatever --statistic says: beside the looping small neighbour the phase is random, a
        # minimum picks the luckiest alignment (a call that ran while the neighbour was between calls)
        out += [{"kind": "corun", "call": n, "alone_s": float(np.median(times[(n, 0)])),
                 "busy_s": float(np.median(times[(n, 1)])), "neighbour": kind,
                 "neighbour_s": float(np.mean([np.median(v) for v in alone_n.values()])),
                 **({"neighbour_kind": "process"} if proc is not None else {}),
                 **({"pinned": True} if neighbour_core is not None else {})} for n in timed]
    if proc is not None:
        proc.close()
    return out


#: where a one-process launcher of multi-device computations is documented (see :func:`measure_launch`)
LAUNCH_SOURCE = ("openxla/xla xla/pjrt/cpu/cpu_client.cc, PjRtCpuLoadedExecutable::Execute: a multi-device "
                 "execution waits for the client's previous one ('We conservatively run only one collective "
                 "at a time'); a one-device execution runs on the calling thread")


def measure_launch(cfg: Any, devices: Sequence[Any], seq_len: int, repeats: int) -> List[dict]:
    """Whether this process runs its multi-device computations one at a time: a short probe (a first
    stage's forward, layer 0, one sample) on a 2-device ``(1, 2)`` mesh ``devices[0:2]``, and as a
    control on one device ``devices[0]``, timed alone and while a second thread runs a long neighbour
    (a last stage's fused forward + backward, last layer, 4 samples) in a loop on the ``(1, 2)`` mesh
    ``devices[2:4]`` -- as two islands of one process do with DP or TP stages. Each probe beside the
    neighbour starts a tenth of the neighbour's (alone) seconds after one of its calls began, as a
    first stage's backward starts right after the last stage began its next forward + backward in
    a pipeline. A launcher that runs one multi-device computation at a time makes the 2-device probe
    wait for the rest of that call (up to 0.9 of it); shared cores alone slow it by a few times its
    own seconds. Returns ``{"kind": "launch", "mesh": "1x2" | "1x1", "alone_s", "busy_s", "neighbour_s"}``
    (medians over ``repeats`` alternating calls; ``neighbour_s``: the neighbour's call alone); empty
    with fewer than 4 devices. :func:`fit_launch` reads them."""
    import threading

    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    if len(devices) < 4:
        return []
    import jax
    import jax.numpy as jnp

    from hethub_jax.parallel.stage import StageInputs
    tx, L = make_optimizer(OptimConfig()), cfg.num_hidden_layers
    mk = lambda fl, ll, ds, tp: PipelineStage(cfg, fl, ll, list(ds), 1, tp, seed=0, recompute=False, optimizer=tx)
    probes = {"1x2": _stage_call(mk(0, 0, devices[0:2], 2), cfg, seq_len, "F"),
              "1x1": _stage_call(mk(0, 0, devices[0:1], 1), cfg, seq_len, "F")}
    other = mk(L - 1, L - 1, devices[2:4], 2)
    tokens, pos, mask, x_dev = _inputs(other, cfg, 4, seq_len)
    placed = StageInputs(x_dev, other.place_tokens(pos), other.place_tokens(tokens), other.place_tokens(mask))
    no = np.bool_(False)
    neighbour = lambda: jax.block_until_ready(other.forward_backward(other.params, placed, other.new_grad_buffer(), no))
    busy, stop, idle, began = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def loop():
        while not stop.is_set():
            if busy.wait(0.01):
                idle.clear()
                began.set()
                neighbour()
            else:
                idle.set()
    for fn in probes.values():
        fn()
    neighbour()
    alone_n = []
    for _ in range(max(3, repeats // 2)):
        t0 = time.perf_counter()
        neighbour()
        alone_n.append(time.perf_counter() - t0)
    th = threading.Thread(target=loop, daemon=True)
    th.start()
    times: Dict[tuple, List[float]] = {}
    lag = 0.1 * float(np.median(alone_n))
    try:
        for i in range(2 * repeats):
            (busy.set if i % 2 else busy.clear)()
            if not i % 2:
                idle.wait(5.0)  # alone: the neighbour's call in progress has ended
            for name, fn in probes.items():
                if i % 2:  # a tenth of a neighbour's call after one began
                    began.clear()
                    began.wait(5.0)
                time.sleep(lag)
                t0 = time.perf_counter()
                fn()
                times.setdefault((name, i % 2), []).append(time.perf_counter() - t0)
    finally:
        stop.set()
        busy.clear()
        th.join()
    return [{"kind": "launch", "mesh": n, "alone_s": float(np.median(times[(n, 0)])),
             "busy_s": float(np.median(times[(n, 1)])), "neighbour_s": float(np.median(alone_n))} for n in probes]


def fit_launch(samples: List[dict]) -> Optional[Dict[str, Any]]:
    """``{"serial", "wait_s", "neighbour_s", "wait_fraction", "probe_fraction", "one_device_wait_s",
    "method", "source"}`` from :func:`measure_launch`'s samples (None without the 2-device one):
    ``serial`` when the 2-device probe's extra seconds beside the neighbour (``wait_s``, busy - alone)
    are at least a fifth of the neighbour's call (``wait_fraction >= 0.2``): waiting for the rest of
    the call it started beside costs up to 0.9 of it (measured 0.30 with XLA's default intra-op
    threads and 4 devices, 1.39 with ``--xla_cpu_multi_thread_eigen=false`` and 8 devices, both on
    this 2-core VM under load, docs/benchmarks.md issue 13), while sharing the cores costs a few times
    the probe's own seconds, ``probe_fraction`` (probe alone / neighbour, measured 0.03-0.05) of the
    neighbour's: a one-sample forward of one layer against a four-sample forward + backward with the
    LM head."""
    two = [s for s in samples if s.get("mesh") == "1x2"]
    if not two:
        return None
    s = two[0]
    one = [x for x in samples if x.get("mesh") == "1x1"]
    wait = max(0.0, s["busy_s"] - s["alone_s"])
    frac = wait / s["neighbour_s"] if s["neighbour_s"] > 0 else 0.0
    return {"serial": bool(frac >= 0.2), "wait_s": wait, "neighbour_s": s["neighbour_s"], "wait_fraction": frac,
            "probe_fraction": s["alone_s"] / s["neighbour_s"] if s["neighbour_s"] > 0 else None,
            "one_device_wait_s": max(0.0, one[0]["busy_s"] - one[0]["alone_s"]) if one else None,
            "method": "profile.measure_launch: a 2-device probe beside a 2-device neighbour in a loop, one process",
            "source": LAUNCH_SOURCE}


def measure_update_pair(cfg: Any, devices: Sequence[Any], repeats: int) -> List[dict]:
    """The optimizer updates of two islands of one process run at the SAME time, against each alone:
    after a step's pipeline every island sums its shared gradients, reads its norm, meets the others
    in one all-reduce (``PipelineRuntime._forward_backward``) and then updates, so islands sharing a
    host's cores start their updates together. AdamW streams parameters, gradients and both moments
    (7 accesses per parameter): two at once share the host's memory bandwidth, a slowdown that the
    neighbour of :func:`measure_corun` (a stage's forward + backward) does not show.

    A first stage (layer 0 and the embedding) on ``devices[0]`` and a last stage (the last layer and
    the LM head, with the tied embedding) on ``devices[1]``, as the two islands of a two-stage
    pipeline hold them; per repetition (after a compiling update each) the first stage's update alone,
    the last stage's alone, then both started together by a barrier (one in a second thread), each
    timed to its own result. Returns ``{"kind": "corun_update", "alone_s", "busy_s"}``: the summed
    medians of the two updates alone and together (median whatever ``--statistic`` says, as
    :func:`measure_corun`). Empty with fewer than 2 devices."""
    import threading

    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    if len(devices) < 2:
        return []
    tx, L = make_optimizer(OptimConfig()), cfg.num_hidden_layers
    stages = [PipelineStage(cfg, 0, 0, [devices[0]], 1, 1, seed=0, recompute=False, optimizer=tx),
              PipelineStage(cfg, L - 1, L - 1, [devices[1]], 1, 1, seed=0, recompute=False, optimizer=tx)]
    for st in stages:
        _update_once(st)
    bar, stop, took = threading.Barrier(2), threading.Event(), {}

    def other():
        while True:
            bar.wait()
            if stop.is_set():
                return
            t0 = time.perf_counter()
            _update_once(stages[1])
            took["other"] = time.perf_counter() - t0
            bar.wait()
    th = threading.Thread(target=other, daemon=True)
    th.start()
    times: Dict[str, List[float]] = {"alone0": [], "alone1": [], "busy0": [], "busy1": []}
    try:
        for _ in range(max(1, repeats)):
            for i, st in enumerate(stages):
                t0 = time.perf_counter()
                _update_once(st)
                times[f"alone{i}"].append(time.perf_counter() - t0)
            bar.wait()
            t0 = time.perf_counter()
            _update_once(stages[0])
            times["busy0"].append(time.perf_counter() - t0)
            bar.wait()
            times["busy1"].append(took["other"])
    finally:
        stop.set()
        bar.wait()
        th.join()
    med = {k: float(np.median(v)) for k, v in times.items()}
    return [{"kind": "corun_update", "alone_s": med["alone0"] + med["alone1"], "busy_s": med["busy0"] + med["busy1"],
             "per_stage": med}]


#: at least this many steps per mode in :func:`measure_tail_pair` (one profile read 1.43 at 5 per mode
#: where interleaved runs of the same minutes read 1.87-2.12: a step is ~0.1 s, so more are cheap)
TAIL_PAIR_MIN_STEPS = 10


def measure_tail_pair(cfg: Any, devices: Sequence[Any], repeats: int, seq_len: int = 16) -> List[dict]:
    """The islands' optimizer updates as the runtime runs them after a step's pipeline, together and
    one at a time: a two-island pipeline of this process (islands as threads, ``LocalCommunicator``,
    one device each; the layers split in half, the tied embedding on both islands, 2 microbatches),
    real ``PipelineRuntime.train_step`` calls, alternating per step between the runtime's own way
    (both islands update at once after the world all-reduce) and one island's update at a time (a
    lock around ``_apply_updates``); each island's update timed from its start to its parameters'
    result (``train_step`` waits for them next anyway). Unlike :func:`measure_update_pair` (two
    updates of warm one-layer stages on zero gradients, started by a barrier) the updates here run
    in the step's state (after the pipeline, the gradient sums and placement, the global norm), with
    the gradients and shapes the runtime updates. ``1 + 2 x max(repeats, TAIL_PAIR_MIN_STEPS)`` timed
    steps after a compiling one and a warm-up one (a few seconds on the tiny model).

    Returns ``[{"kind": "corun_tail", "alone_s", "busy_s", "per_island", "params"}]``: the summed
    medians over the islands of their update one at a time (``alone_s``) and together (``busy_s``),
    seconds; ``params``: per island the parameters it updates. Empty with fewer than 2 devices or an
    untied model (no parameter shared by the islands' stages: not the runtime's usual tail)."""
    import threading

    import jax

    from hethub_jax.comm import LocalCommunicator
    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.runtime import PipelineRuntime
    if len(devices) < 2 or not cfg.tie_word_embeddings or cfg.num_hidden_layers < 2:
        return []
    n, half = cfg.num_hidden_layers, cfg.num_hidden_layers // 2
    isl = [{"name": x, "platform": devices[0].platform, "devices_per_process": 1} for x in "ab"]
    plan = Plan.from_dict({"islands": isl, "global_batch_size": 2, "microbatch_size": 1, "stages": [
        {"island": "a", "first_layer": 0, "last_layer": half - 1},
        {"island": "b", "first_layer": half, "last_layer": n - 1}]})
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab_size, (2, seq_len), dtype=np.int32),
             "targets": rng.integers(0, cfg.vocab_size, (2, seq_len), dtype=np.int32),
             "loss_mask": np.ones((2, seq_len), np.float32)}
    comms, lock, barrier = LocalCommunicator.create(2, timeout=600), threading.Lock(), threading.Barrier(2)
    steps = 2 + 2 * max(TAIL_PAIR_MIN_STEPS, repeats) + 1  # per mode at least TAIL_PAIR_MIN_STEPS (noisy)
    took: Dict[int, Dict[str, List[float]]] = {0: {"together": [], "alone": []}, 1: {"together": [], "alone": []}}
    params: Dict[int, int] = {}
    errors: List[BaseException] = []

    def body(rank: int) -> None:
        try:
            rt = PipelineRuntime(plan, cfg, OptimConfig(), seed=0, comm=comms[rank], rank=rank, devices=[devices[rank]])
            apply = rt._apply_updates
            params[rank] = int(sum(v.size for k in rt.local_keys for v in rt.stages[k].flat().values()))
            for i in range(steps):
                one = i % 2 == 1

                def timed(*a, one=one, i=i):
                    with lock if one else contextlib.nullcontext():
                        t0 = time.perf_counter()
                        apply(*a)
                        jax.block_until_ready([rt._stages[k].params for k in rt.local_keys])
                        if i >= 2:
                            took[rank]["alone" if one else "together"].append(time.perf_counter() - t0)
                rt._apply_updates = timed
                barrier.wait()
                rt.train_step(batch)
        except BaseException as e:  # noqa: BLE001 -- re-raised after the join
            errors.append(e)
            barrier.abort()
    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    med = {r: {m: float(np.median(v)) for m, v in took[r].items()} for r in took}
    return [{"kind": "corun_tail", "alone_s": sum(m["alone"] for m in med.values()),
             "busy_s": sum(m["together"] for m in med.values()),
             "per_island": {"ab"[r]: m for r, m in med.items()}, "params": {"ab"[r]: p for r, p in params.items()}}]


def fit_corun_update(samples: List[dict]) -> Optional[Dict[str, Any]]:
    """``{"factor"}``: the summed busy seconds over the summed alone seconds of the islands' updates
    together and alone: the ``corun_tail`` samples (:func:`measure_tail_pair`: as the runtime runs its
    tail) when there are any, else the ``corun_update`` samples (:func:`measure_update_pair`: warm
    updates on zero gradients); None without either."""
    tail = [s for s in samples if s.get("kind") == "corun_tail"]
    use = tail or [s for s in samples if s.get("kind", "corun_update") == "corun_update"]
    if not use or sum(s["alone_s"] for s in use) <= 0:
        return None
    how = ("two islands' updates in a two-island PipelineRuntime step, together over one at a time "
           "(profile.measure_tail_pair)" if tail else
           "two islands' optimizer updates started together over each alone (profile.measure_update_pair)")
    return {"factor": float(sum(s["busy_s"] for s in use) / sum(s["alone_s"] for s in use)), "method": how}


def _phase_calls(st: Any, cfg: Any, seq_len: int) -> Dict[str, Callable[[], Any]]:
    """Blocking calls of stage ``st`` on one one-sample microbatch per phase the runtime runs
    (``F`` forward_saving, ``F_nosave`` forward, ``B`` backward_saved, ``B_recompute``
    backward_recompute; on the last stage ``B_recompute`` is the fused forward_backward), each placing
    its host inputs as the runtime's F action does; the gradient accumulator is donated and replaced
    after every backward, as the runtime does (no zeroing inside the timed call)."""
    import jax
    import jax.numpy as jnp

    from hethub_jax.parallel.stage import StageInputs
    tokens, pos, mask, x_dev = _inputs(st, cfg, 1, seq_len)
    no = np.bool_(False)
    args = lambda: StageInputs(st.place_tokens(tokens) if st.is_first else x_dev, st.place_tokens(pos),
                               *((st.place_tokens(tokens), st.place_tokens(mask)) if st.is_last else ()))
    g = jnp.ones((), jnp.float32) if st.is_last else jax.device_put(
        jnp.ones((1, seq_len, cfg.hidden_size), cfg.dtype), st.act_sharding)
    saved = st.forward_saving(st.params, args())[1]
    box = {"acc": st.new_grad_buffer()}

    def acc_call(fn):
        def call():
            out = fn(box["acc"])
            box["acc"] = out.acc if hasattr(out, "acc") else out[1].acc  # Backward, or (loss, Backward)
            jax.block_until_ready(box["acc"])
        return call
    calls = {"F": lambda: jax.block_until_ready(st.forward_saving(st.params, args())[0]),
             "F_nosave": lambda: jax.block_until_ready(st.forward(st.params, args())),
             "B": acc_call(lambda acc: st.backward_saved(saved, g, acc, no))}
    calls["B_recompute"] = (acc_call(lambda acc: st.forward_backward(st.params, args(), acc, no)) if st.is_last
                            else acc_call(lambda acc: st.backward_recompute(st.params, args(), g, acc, no)))
    return calls


def measure_cold(cfg: Any, devices: Sequence[Any], seq_len: int, repeats: int) -> List[dict]:
    """Each stage call's cost right after ANOTHER stage's call against right after itself: in a
    pipeline a stage's call follows a different call (its own other phase, another stage of the
    island, another island of the host), which has replaced what the call left in the CPU caches;
    the profile's compute fits time each call back to back (warm).

    A first stage (layer 0), a middle stage (layer 1) and a last stage (last layer), one device
    (``devices[0]``), one one-sample microbatch; per stage and phase (:func:`_phase_calls`) the call is
    timed alternately right after itself ("warm") and right after the EVICTOR, the other end's
    heaviest call (for the first and middle stages the last stage's fused forward + backward; for
    the last stage the first stage's backward then forward), ``repeats`` times each after compiling.
    Process CPU seconds (``time.process_time``: the cache misses' stalls are CPU time, and a ratio of
    CPU seconds is not moved by other processes' load the way wall seconds are) and wall seconds of
    each. Returns one ``{"kind": "cold", "position", "phase", "warm_cpu_s", "cold_cpu_s",
    "warm_wall_s", "cold_wall_s"}`` per stage and phase (medians)."""
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    tx, L = make_optimizer(OptimConfig()), cfg.num_hidden_layers
    mk = lambda fl, ll: PipelineStage(cfg, fl, ll, [devices[0]], 1, 1, seed=0, recompute=False, optimizer=tx)
    stages = {"first": mk(0, 0), "middle": mk(1, 1), "last": mk(L - 1, L - 1)}
    calls = {pos: _phase_calls(st, cfg, seq_len) for pos, st in stages.items()}
    last_fb, first = calls["last"]["B_recompute"], calls["first"]
    evictor = {"first": last_fb, "middle": last_fb, "last": lambda: (first["B"](), first["F"]())}
    out = []
    for pos, phases in calls.items():
        for phase, fn in phases.items():
            fn(), evictor[pos]()
            t: Dict[str, List[tuple]] = {"warm": [], "cold": []}
            for i in range(2 * repeats):
                cond = "cold" if i % 2 else "warm"
                (evictor[pos] if cond == "cold" else fn)()
                c0, w0 = time.process_time(), time.perf_counter()
                fn()
                t[cond].append((time.process_time() - c0, time.perf_counter() - w0))
            med = lambda xs, j: float(np.median([x[j] for x in xs]))
            out.append({"kind": "cold", "position": pos, "phase": phase,
                        "warm_cpu_s": med(t["warm"], 0), "cold_cpu_s": med(t["cold"], 0),
                        "warm_wall_s": med(t["warm"], 1), "cold_wall_s": med(t["cold"], 1)})
    return out


def fit_cold(samples: List[dict]) -> Optional[Dict[str, Any]]:
    """``{position: {phase: seconds}}`` (positions ``first``, ``middle``, ``last``): the extra process
    CPU seconds of each measured call (:func:`measure_cold`) right after another stage's call over
    right after itself, at least 0 (below 0 is noise); None without samples. A cost per CALL: a
    first stage's F of 3 layers and of 1 layer pay about the same extra (docs/benchmarks.md, issue
    13)."""
    out: Dict[str, Any] = {}
    for s in samples:
        out.setdefault(s["position"], {})[s["phase"]] = max(0.0, s["cold_cpu_s"] - s["warm_cpu_s"])
    if not out:
        return None
    out["method"] = ("extra process CPU seconds of each call right after another stage's call over right after "
                     "itself (one device, one one-sample microbatch; profile.measure_cold)")
    return out


def _record_cpu(rt: Any, out: List[tuple]) -> Callable[[], None]:
    """Makes ``rt``'s step executor append ``(stage, action str, process CPU s, wall s)`` to ``out`` for
    every action it executes (wrapping ``_StepExecutor._execute`` of ``rt`` only); returns the undo."""
    from hethub_jax.parallel import runtime as R
    orig = R._StepExecutor._execute

    def execute(self, k, a, nxt):
        if self.rt is not rt:
            return orig(self, k, a, nxt)
        c0, w0 = time.process_time(), time.perf_counter()
        orig(self, k, a, nxt)
        out.append((k[1], str(a), time.process_time() - c0, time.perf_counter() - w0))
    R._StepExecutor._execute = execute
    return lambda: setattr(R._StepExecutor, "_execute", orig)


def in_flight_counts(actions: Sequence[Any]) -> List[Optional[int]]:
    """Per action of one stage's list (``hethub_jax.parallel.schedule.Action``), the microbatches in
    flight while it runs -- forwards run whose backward has not, its own microbatch included -- for
    F and B; None for the other actions. A last stage's F that the runtime fuses with the directly
    following B of its microbatch counts as any F (the caller skips fused pairs)."""
    live, out = set(), []
    for a in actions:
        kind = str(a.kind)
        if kind == "F":
            live.add(a.microbatch)
            out.append(len(live))
        elif kind == "B":
            out.append(len(live))
            live.discard(a.microbatch)
        else:
            out.append(None)
    return out


def measure_in_flight(cfg: Any, devices: Sequence[Any], seq_len: int, repeats: int) -> List[dict]:
    """Each stage call as the runtime makes it with ``n`` microbatches in flight (forwards run whose
    backward has not: their residuals, or with recompute their inputs, held alive) against the same
    call alone, as the compute fits time it (one call repeated back to back, ``_phase_calls``).

    Why: under GPipe every stage holds all M microbatches before its first backward
    (``schedule.in_flight_bound``) and a last stage runs its F and B unfused, each backward reading
    residuals written several calls earlier; under 1F1B at most ``S - s`` are held and the last stage
    fuses F and B. In the quiet two-island run the last stage's unfused calls took 1.41-1.47x their
    PREDICTED seconds and its fused calls 1.08x (docs/benchmarks.md, issue 13, session 13).

    The smallest setting that has a schedule: the profiler's one-island runtime
    (``_one_island_runtime``: one island of this process, one thread, two stages -- the layers split in
    half, one device each -- 4 one-sample microbatches of ``seq_len`` tokens), GPipe and 1F1B, with
    recompute ``none`` (phases ``F`` / ``B``) and ``full`` (``F_nosave`` / ``B_recompute``). Per round,
    alternating: one step of each runtime, every F and B action's process CPU seconds
    (``time.process_time``: one thread runs the island, so these are the action's compute and Python;
    a ratio of CPU seconds in one alternation is not moved by other processes' load as wall seconds
    are) and wall seconds, and each stage's two calls alone (F, then B on one warm set of residuals).
    A last stage's fused F+B is left out (no microbatch is held across it). Stage 0 is position
    ``"first"``, stage 1 ``"last"``. ``repeats`` rounds after one untimed round (compilation).

    Returns one ``{"kind": "in_flight", "position", "phase", "count", "ratio_cpu", "ratio_wall",
    "cpu_s", "alone_cpu_s", "wall_s", "alone_wall_s", "calls"}`` per position, phase and count: the
    medians over rounds of (the round's mean over the actions at that count) / (the round's call
    alone), and of the seconds. Empty with fewer than 2 devices.
    """
    if len(devices) < 2:
        return []
    out = []
    for recompute, (f_phase, b_phase) in (("none", ("F", "B")), ("full", ("F_nosave", "B_recompute"))):
        rts = [_one_island_runtime(cfg, devices, sched, seq_len, recompute) for sched in ("gpipe", "1f1b")]
        per_round: List[Dict[tuple, list]] = []
        for i in range(repeats + 1):
            t: Dict[tuple, list] = {}
            for rt, batch in rts:
                recs: List[tuple] = []
                undo = _record_cpu(rt, recs)
                try:
                    rt.train_step(batch)
                finally:
                    undo()
                acts = rt.train_actions[0]
                for s, lst in enumerate(acts):
                    counts = in_flight_counts(lst)
                    mine = [r for r in recs if r[0] == s]
                    fused = {j for j in range(len(lst) - 1) if s == len(acts) - 1 and rt.fuse_last_stage
                             and str(lst[j].kind) == "F" and str(lst[j + 1].kind) == "B"
                             and lst[j + 1].microbatch == lst[j].microbatch}
                    for j, (a, n, r) in enumerate(zip(lst, counts, mine)):
                        if n is None or j in fused or j - 1 in fused:
                            continue
                        t.setdefault((s, f_phase if str(a.kind) == "F" else b_phase, n), []).append(r[2:])
            st = {s: rts[0][0]._stages[(0, s)] for s in range(2)}
            for s, stage in st.items():
                calls = _phase_calls(stage, cfg, seq_len)
                for phase in (f_phase, b_phase):
                    # a last stage's B_recompute in _phase_calls is the fused F+B; unfused it is backward_recompute
                    fn = (_last_backward_recompute(stage, cfg, seq_len) if phase == "B_recompute" and stage.is_last
                          else calls[phase])
                    fn()
                    for _ in range(2):
                        c0, w0 = time.process_time(), time.perf_counter()
                        fn()
                        t.setdefault((s, phase, 0), []).append((time.process_time() - c0, time.perf_counter() - w0))
            if i:
                per_round.append(t)
        for s in range(2):
            for phase in (f_phase, b_phase):
                for n in sorted({k[2] for t in per_round for k in t if k[:2] == (s, phase) and k[2] > 0}):
                    mean = lambda t, j, key: float(np.mean([x[j] for x in t[key]]))  # noqa: E731
                    rounds = [t for t in per_round if (s, phase, n) in t and (s, phase, 0) in t]
                    row = {"kind": "in_flight", "position": "first" if s == 0 else "last", "phase": phase,
                           "count": n, "calls": sum(len(t[(s, phase, n)]) for t in rounds)}
                    for j, unit in ((0, "cpu"), (1, "wall")):
                        row[f"ratio_{unit}"] = float(np.median([
                            mean(t, j, (s, phase, n)) / max(mean(t, j, (s, phase, 0)), 1e-12) for t in rounds]))
                        row[f"{unit}_s"] = float(np.median([mean(t, j, (s, phase, n)) for t in rounds]))
                        row[f"alone_{unit}_s"] = float(np.median([mean(t, j, (s, phase, 0)) for t in rounds]))
                    out.append(row)
        del rts
    return out


def _last_backward_recompute(st: Any, cfg: Any, seq_len: int) -> Callable[[], Any]:
    """A last stage's ``backward_recompute`` on one one-sample microbatch (what the runtime runs for a
    last stage's B under recompute ``full`` when it is not fused with its F), blocking."""
    import jax
    import jax.numpy as jnp

    from hethub_jax.parallel.stage import StageInputs
    tokens, pos, mask, x_dev = _inputs(st, cfg, 1, seq_len)
    inputs = StageInputs(x_dev, st.place_tokens(pos), st.place_tokens(tokens), st.place_tokens(mask))
    g, no, box = jnp.ones((), jnp.float32), np.bool_(False), {"acc": st.new_grad_buffer()}

    def call():
        box["acc"] = st.backward_recompute(st.params, inputs, g, box["acc"], no).acc
        jax.block_until_ready(box["acc"])
    return call


def fit_in_flight(samples: List[dict]) -> Optional[Dict[str, Any]]:
    """``{"factors": {position: {phase: [[count, factor], ...]}}, "method"}`` (positions ``first``,
    ``last``; counts ascending): per stage position, phase and microbatches in flight the MEASURED
    factor of a runtime call's seconds over the same call alone, :func:`measure_in_flight`'s
    ``ratio_cpu`` (process CPU seconds), floored at 0.5 (lower is noise); None without samples.
    ``DeviceCosts.in_flight_factor`` reads it."""
    out: Dict[str, Dict[str, list]] = {}
    for s in sorted(samples, key=lambda s: int(s["count"])):
        out.setdefault(s["position"], {}).setdefault(s["phase"], []).append(
            [int(s["count"]), max(0.5, float(s["ratio_cpu"]))])
    if not out:
        return None
    return {"factors": out,
            "method": ("process CPU seconds of each F / B action of a one-island, one-thread PipelineRuntime step "
                       "(two stages, 4 one-sample microbatches, GPipe and 1F1B, recompute none and full) with n "
                       "microbatches in flight over the same call alone, median over rounds "
                       "(profile.measure_in_flight)")}


def measure_local_bridge(sizes: Sequence[int], repeats: int) -> List[dict]:
    """Seconds of an all-reduce (``allreduce_tree``, sum) of ``n`` float32 bytes between two threads
    over ``LocalCommunicator``: the bridge of islands that are threads of one process (as in
    ``benchmarks/predictor_accuracy.py``); the slower thread's statistic over ``repeats`` calls after
    one untimed call. Returns ``{"kind": "bridge_local", "bytes", "seconds"}`` per size."""
    import threading

    from hethub_jax.comm import LocalCommunicator
    out = []
    for n in sizes:
        comms, x, res = LocalCommunicator.create(2, timeout=120), np.ones(max(1, n // 4), np.float32), {}

        def body(r):
            res[r] = _median_time(lambda: comms[r].allreduce_tree({"g": x}), repeats)
        threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out.append({"kind": "bridge_local", "bytes": n, "seconds": max(res.values())})
    return out


def _one_island_runtime(cfg: Any, devices: Sequence[Any], schedule: str, seq_len: int, recompute: str = "none"):
    """``(runtime, batch)``: one island of this process on two devices, two stages (the layers split in
    half), ``schedule``, 4 one-sample microbatches of ``seq_len`` random tokens (seed 0), recompute
    policy ``recompute``; no action waits on another process. For the profiler's measurements of the
    runtime's own seconds."""
    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.runtime import PipelineRuntime
    n, half = cfg.num_hidden_layers, cfg.num_hidden_layers // 2
    plan = Plan.from_dict({"islands": [{"name": "p", "platform": devices[0].platform, "devices_per_process": 2}],
                           "global_batch_size": 4, "microbatch_size": 1, "schedule": schedule,
                           "recompute": recompute, "stages": [
                               {"island": "p", "first_layer": 0, "last_layer": half - 1},
                               {"island": "p", "first_layer": half, "last_layer": n - 1}]})
    rt = PipelineRuntime(plan, cfg, OptimConfig(), devices=list(devices[:2]))
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab_size, (4, seq_len), dtype=np.int32),
             "targets": rng.integers(0, cfg.vocab_size, (4, seq_len), dtype=np.int32),
             "loss_mask": np.ones((4, seq_len), np.float32)}
    return rt, batch


def measure_runtime_overhead(cfg: Any, devices: Sequence[Any], repeats: int) -> List[dict]:
    """Seconds of the runtime's own work per action -- Python dispatch and bookkeeping between and
    around the compute calls, the step's start, same-island messages -- measured on the runtime
    itself (``PipelineRuntime.train_step``): one island of this process, two stages (the layers
    split in half), GPipe, 4 microbatches, so that no action waits on another process. Per step (after
    a compiling one): the seconds from the step's start to its last action's end minus the summed
    durations of its F and B records, with the number of actions. Empty with fewer than 2 devices."""
    if len(devices) < 2:
        return []
    rt, batch = _one_island_runtime(cfg, devices, "gpipe", 16)
    out = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        recs = rt.train_step(batch).records
        busy = sum(r.end_s - r.start_s for r in recs if r.action[:1] in ("F", "B"))
        if i:
            out.append({"kind": "runtime_overhead", "actions": len(recs),
                        "seconds": max(r.end_s for r in recs) - t0 - busy})
    return out


def fit_runtime_overhead(samples: List[dict]) -> Optional[Dict[str, Any]]:
    """``{"per_action_s"}``: the statistic (:data:`STATISTIC`) over steps of overhead seconds / actions;
    None without samples."""
    if not samples:
        return None
    per = [s["seconds"] / s["actions"] for s in samples if s["actions"]]
    return {"per_action_s": float(np.min(per) if STATISTIC["name"] == "min" else np.median(per)),
            "plan": "one island, 2 stages, GPipe, 4 microbatches, one process"}


def measure_action_costs(cfg: Any, devices: Sequence[Any], seq_len: int, repeats: int) -> List[dict]:
    """Seconds of the runtime's pipeline actions that compute nothing, read from its own records
    (``PipelineRuntime.train_step``): one island of this process on two devices, two stages (the
    layers split in half), 1F1B, 4 one-sample microbatches of ``seq_len`` tokens, so that no action
    waits on another process and the last stage's F+B run fused. Per step (after a compiling one):
    the mean record seconds of its SENDs (the activation or gradient handed to the mailbox; a SEND to
    another island copies to the host too, ``host_copy``), its RECVs (the message placed on the
    stage's sharding), its fused Bs (the last stage's B record after its fused F+B: Python only) and
    the seconds between records per action (step start to the last record's end, less every record's
    seconds, over the actions). Returns one ``{"kind": "action_costs", "send_s", "recv_s",
    "fused_b_s", "gap_s", "actions"}`` per timed step; empty with fewer than 2 devices."""
    if len(devices) < 2:
        return []
    rt, batch = _one_island_runtime(cfg, devices, "1f1b", seq_len)
    out = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        recs = rt.train_step(batch).records
        if not i:
            continue
        dur = lambda r: r.end_s - r.start_s  # noqa: E731
        kinds: Dict[str, List[float]] = {"send": [], "recv": [], "fused_b": []}
        last = {}  # per stage its previous record
        for r in recs:
            if r.action.startswith("SEND"):
                kinds["send"].append(dur(r))
            elif r.action.startswith("RECV"):
                kinds["recv"].append(dur(r))
            elif (r.action[:1] == "B" and r.stage == 1 and last.get(1) is not None
                  and last[1].action == "F" + r.action[1:]):
                kinds["fused_b"].append(dur(r))
            last[r.stage] = r
        gap = (max(r.end_s for r in recs) - t0 - sum(dur(r) for r in recs)) / len(recs)
        out.append({"kind": "action_costs", "actions": len(recs), "gap_s": max(0.0, gap),
                    **{f"{k}_s": float(np.mean(v)) if v else 0.0 for k, v in kinds.items()}})
    return out


def fit_action_costs(samples: List[dict]) -> Optional[Dict[str, Any]]:
    """``{"send_s", "recv_s", "fused_b_s", "gap_s"}``: per figure the statistic (:data:`STATISTIC`)
    over the steps of :func:`measure_action_costs`; None without samples."""
    if not samples:
        return None
    stat = np.min if STATISTIC["name"] == "min" else np.median
    out: Dict[str, Any] = {k: float(stat([s[k] for s in samples])) for k in ("send_s", "recv_s", "fused_b_s", "gap_s")}
    out["plan"] = "one island, 2 stages, 1F1B, 4 microbatches, one process (PipelineRuntime records)"
    return out


#: seconds asked of the emulated wait by :func:`measure_emulated_wait`: a fused B's wait (0.2 ms) to a
#: large stage call's (20 ms)
EMULATED_WAITS_S = (0.0002, 0.001, 0.005, 0.02)


def measure_emulated_wait(repeats: int, waits: Sequence[float] = EMULATED_WAITS_S) -> List[dict]:
    """Seconds the runtime's emulated wait (``hethub_jax.parallel.runtime.emulated_wait``, a sleep)
    takes when asked to wait ``x`` seconds, for each ``x`` of ``waits``: a sleep wakes late (the
    kernel's timer slack, the wake-up's scheduling), and an EMULATED slow island waits after every
    compute action. The median of ``repeats`` waits (the waits of a step are many: a minimum would
    pick the luckiest wake-up). Returns ``{"kind": "emulated_wait", "requested_s", "seconds"}`` per
    ``x``."""
    from hethub_jax.parallel import runtime
    out = []
    for x in waits:
        ts = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            runtime.emulated_wait(x)
            ts.append(time.perf_counter() - t0)
        out.append({"kind": "emulated_wait", "requested_s": float(x), "seconds": float(np.median(ts))})
    return out


def fit_emulated_wait(samples: List[dict]) -> Optional[Dict[str, Any]]:
    """``{"c0", "c1"}``: the emulated wait asked for ``x`` seconds takes ``c0 + c1 x``: ``c1 = 1`` (a
    sleep's length is what it is asked) and ``c0`` the median over the asked sizes of (measured -
    asked) seconds, at least 0 (a late wake-up does not grow with the sleep; a least-squares line
    through 4 sizes follows a single late wake-up); None without samples."""
    if not samples:
        return None
    late = {str(s["requested_s"]): s["seconds"] - s["requested_s"] for s in samples}
    return {"c0": max(0.0, float(np.median(list(late.values())))), "c1": 1.0, "late_s": late,
            "method": "median over the asked sizes of the median wait's lateness (profile.measure_emulated_wait)"}


def _update_once(st: Any) -> None:
    """One blocking optimizer update of stage ``st`` with a zero gradient (the update's cost)."""
    import jax
    st.params, st.opt_state = st.update(st.params, st.opt_state, st.new_grad_buffer(), np.float32(1e-3),
                                        np.float32(1.0))
    jax.block_until_ready(st.params)


def _stage_call(st: Any, cfg: Any, seq_len: int, phase: str, placed_once: bool = False) -> Callable[[], Any]:
    """A blocking call of stage ``st`` on one one-sample microbatch: phase ``"F"`` (forward_saving),
    ``"B"`` (backward_saved) or ``"B_recompute"`` (the last stage's fused forward_backward), each
    placing its host inputs as the runtime does (``placed_once``: placed once, so that a neighbour in
    a loop computes with as few gaps as possible)."""
    import jax
    import jax.numpy as jnp

    from hethub_jax.parallel.stage import StageInputs
    tokens, pos, mask, x_dev = _inputs(st, cfg, 1, seq_len)
    no = np.bool_(False)
    args = lambda: StageInputs(st.place_tokens(tokens) if st.is_first else x_dev, st.place_tokens(pos),
                               *((st.place_tokens(tokens), st.place_tokens(mask)) if st.is_last else ()))
    if placed_once:
        placed = args()
        args = lambda: placed
    if phase == "F":
        return lambda: jax.block_until_ready(st.forward_saving(st.params, args())[0])
    if phase == "B_recompute" and st.is_last:
        return lambda: jax.block_until_ready(st.forward_backward(st.params, args(), st.new_grad_buffer(), no))
    saved = st.forward_saving(st.params, args())[1]
    g = jax.device_put(jnp.ones((1, seq_len, cfg.hidden_size), cfg.dtype), st.act_sharding)
    return lambda: jax.block_until_ready(st.backward_saved(saved, g, st.new_grad_buffer(), no)[0])


def fit_corun(samples: List[dict]) -> Optional[Dict[str, Any]]:
    """``{"factor", "ratios", "neighbour", "relation"}`` from :func:`measure_corun`'s samples; None
    without samples.

    ``factor``: the summed busy seconds over the summed alone seconds of the calls timed beside the
    LARGE neighbour (time-weighted, as a step's time is; every sample in profiles without a
    ``neighbour`` field); ``ratios``: each of those calls' busy / alone. ``relation``: the co-run
    slowdown as a function of the pair's size, ``[[size_ratio, extra], ...]`` sorted by
    ``size_ratio`` = the call's alone seconds / its neighbour's alone seconds per call, ``extra`` =
    busy / alone - 1 (at least 0: a call faster beside a neighbour is noise), one point per sample
    that has ``neighbour_s``, stage calls only (not the update; points of equal ratio averaged); empty
    for older samples. The predictor interpolates it (``DeviceCosts.corun_extra``)."""
    if not samples:
        return None
    large = [s for s in samples if s.get("neighbour", "large") == "large" and s["alone_s"] > 0]
    if not large or sum(s["alone_s"] for s in large) <= 0:
        return None
    ratios = {s["call"]: s["busy_s"] / s["alone_s"] for s in large}
    factor = sum(s["busy_s"] for s in large) / sum(s["alone_s"] for s in large)
    pts: Dict[float, List[float]] = {}
    for s in samples:
        if s.get("neighbour_s", 0) > 0 and s["alone_s"] > 0 and s["call"] != "last_update":
            pts.setdefault(s["alone_s"] / s["neighbour_s"], []).append(max(0.0, s["busy_s"] / s["alone_s"] - 1.0))
    relation = [[float(r), float(np.mean(e))] for r, e in sorted(pts.items())]
    return {"factor": float(factor), "ratios": ratios, "relation": relation,
            "neighbour_kind": str(large[0].get("neighbour_kind", "thread")),
            "neighbour": "the last stage's fused forward + backward in a loop on another device of the process",
            "small_neighbour": "the first stage's forward then backward in a loop on another device of the process"}


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from ``/proc/<pid>/stat`` (fields 14 and 15
    over ``SC_CLK_TCK``, proc(5)); 0.0 when it cannot be read (no such process, no /proc)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_snapshot(job_pids: Sequence[int] = (), children: bool = False):
    """``(wall s, busy CPU seconds of the whole machine, CPU seconds of this process and of ``job_pids``)``
    now: the machine's from ``/proc/stat`` (user + nice + system + irq + softirq + steal jiffies over
    ``SC_CLK_TCK``; None where it cannot be read), this process's from ``os.times()``, each of
    ``job_pids`` (the job's other processes on this machine, e.g. MPI ranks profiling their own cores
    at the same time) from :func:`process_cpu_seconds`, so that :func:`others_share` counts only
    processes outside the job. ``children``: this process's finished and waited-for children count as its own too
    (``os.times``' children fields: the co-run neighbour process of :func:`measure_corun`, the island jobs of
    ``benchmarks/predictor_accuracy.py``; ``mpiexec`` waits for its ranks)."""
    busy = None
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        busy = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    t = os.times()
    peers = sum(process_cpu_seconds(p) for p in job_pids if int(p) != os.getpid())
    return time.time(), busy, t.user + t.system + peers + (t.children_user + t.children_system if children else 0.0)


def others_share(before, after):
    """Fraction of the machine's CPU time (all cores) between two :func:`cpu_snapshot` s that OTHER
    processes used (the machine's busy seconds minus this process's, over wall x cores); None when
    ``/proc/stat`` is unreadable. On a quiet machine about 0: profiles and benchmarks assume it
    (under ``mpiexec`` the other ranks count as other processes unless the snapshots were given their
    ids, ``cpu_snapshot(job_pids)``)."""
    if before[1] is None or after[1] is None or after[0] <= before[0]:
        return None
    others = (after[1] - before[1]) - (after[2] - before[2])  # /proc/stat sums every core of the machine
    return max(0.0, others) / ((after[0] - before[0]) * (os.cpu_count() or 1))


def _scaled(samples: List[dict], factor: float) -> List[dict]:
    return [dict(s, seconds=s["seconds"] * factor) for s in samples]


def build_profile(cfg: Any, args: Any, samples: List[dict], updates: List[dict], copies: List[dict],
                  allreduce: List[dict], bridge: Optional[List[dict]], platform_name: str,
                  corun: Sequence[dict] = (), bridge_allreduce: Optional[List[dict]] = None) -> Dict[str, Any]:
    """The profile dict (format :data:`hethub_jax.planner.costs.PROFILE_FORMAT`, docs/predictor.md).
    ``bridge_allreduce``: :func:`measure_bridge_allreduce`'s samples (``fits.bridge_allreduce``; None: not
    measured)."""
    import jax
    f = float(args.slowdown)
    # the norm is not emulated by the runtime (as fits.norm): only the update is scaled
    samples = _scaled(samples, f)
    updates = [dict(u, seconds=u["seconds"] * f) if u["kind"] == "update" else u for u in updates]
    line = lambda xs, key: None if not xs else fit_line([x[key] for x in xs], [x["seconds"] for x in xs])
    dps = sorted({int(x.get("dp", 1)) for x in samples} - {1})
    ups = [u for u in updates if u["kind"] == "update"]
    update_fit = line([u for u in ups if u.get("dp", 1) == 1 and u.get("tp", 1) == 1], "params")
    ar = [dict(a, ring_bytes=a["bytes"] * 2 * (a["devices"] - 1) / a["devices"]) for a in allreduce]
    return {
        "format": PROFILE_FORMAT, "device_type": args.device_type or platform_name,
        "machine": {"node": platform.node(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "system": platform.platform()},
        "python": sys.version.split()[0], "jax_version": jax.__version__, "platform": platform_name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "emulated_slowdown": f,
        "emulation_note": ("compute and update times multiplied by the emulated slowdown (the runtime waits "
                           "(f - 1) x each measured action, DESIGN.md section 9)" if f != 1 else "none"),
        "memory_bytes": _device_memory_bytes(platform_name),
        "model": cfg.to_dict(), "seq_len": args.seq_len, "repeats": args.repeats, "statistic": args.statistic,
        "samples": samples + updates + copies + ar + (bridge or []) + (bridge_allreduce or []) + list(corun),
        "host_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "fits": {"compute": fit_compute(cfg, samples, args.seq_len),
                 "compute_dp": {f"{dp}x1": fit_compute(cfg, samples, args.seq_len, dp)["1"] for dp in dps},
                 "update": update_fit,
                 "update_dp": {str(dp): line([u for u in ups if u.get("dp", 1) == dp and u.get("tp", 1) == 1], "params")
                               for dp in dps},
                 "update_tp": {str(tp): line([u for u in ups if u.get("dp", 1) == 1 and u.get("tp", 1) == tp], "params")
                               for tp in sorted({int(u.get("tp", 1)) for u in ups} - {1})},
                 "norm_mesh": {f"{m[0]}x{m[1]}": line([u for u in updates if u["kind"] == "norm_mesh"
                                                       and (u["dp"], u["tp"]) == m], "params")
                               for m in sorted({(u["dp"], u["tp"]) for u in updates if u["kind"] == "norm_mesh"})},
                 "launch": fit_launch([c for c in corun if c["kind"] == "launch"]),
                 "corun": fit_corun([c for c in corun if c["kind"] == "corun"]),
                 "corun_update": fit_corun_update([c for c in corun if c["kind"] in ("corun_update", "corun_tail")]),
                 "runtime": fit_runtime_overhead([c for c in corun if c["kind"] == "runtime_overhead"]),
                 "cold": fit_cold([c for c in corun if c["kind"] == "cold"]),
                 "in_flight": fit_in_flight([c for c in corun if c["kind"] == "in_flight"]),
                 "actions": fit_action_costs([c for c in corun if c["kind"] == "action_costs"]),
                 "emulated_wait": fit_emulated_wait([c for c in corun if c["kind"] == "emulated_wait"]),
                 "chunked_last": fit_chunked_last([c for c in corun if c["kind"] == "chunked_last"]),
                 "bridge_local": line([c for c in corun if c["kind"] == "bridge_local"], "bytes"),
                 "host_copy": line([c for c in copies if c["kind"] == "host_copy"], "bytes"),
                 "shared_sum": fit_shared_sum([c for c in copies if c["kind"] == "shared_sum"]),
                 "shared_sum_mesh": fit_shared_sum_mesh([c for c in copies if c["kind"] == "shared_sum_mesh"]),
                 "norm": line([c for c in copies if c["kind"] == "norm"], "params"),  # no emulated wait (runtime)
                 "update_cold": fit_update_cold([dict(c, seconds=c["seconds"] * f, warm_seconds=c["warm_seconds"] * f)
                                                 for c in copies if c["kind"] == "update_in_step"]),
                 "update_runtime": fit_update_runtime(
                     [dict(c, warm_seconds=c["warm_seconds"] * f) for c in copies if c["kind"] == "update_in_step"],
                     update_fit),
                 "allreduce": line(ar, "ring_bytes"),
                 "bridge": line(bridge or [], "bytes"),
                 "bridge_allreduce": fit_bridge_allreduce(bridge_allreduce or [])},
        "bridge_note": "measured over MPIHostBridge" if bridge else "not measured (run under mpiexec -n 2)",
        "dp_meshes": _dp_meshes_note(dps, platform_name),
    }


def _dp_meshes_note(dps: Sequence[int], platform_name: str) -> Dict[str, Any]:
    """What the ``(dp, 1)`` mesh fits (``fits.compute_dp``) measured: the DP degrees and whether the
    mesh's devices share one host's cores (the cpu platform's fake devices, ``XLA_FLAGS
    --xla_force_host_platform_device_count``), in which case a DP-d stage is NOT d times faster than
    one device and the predictor uses the measured per-DP-rank time (``DeviceCosts.dp_fits``)."""
    shared = platform_name == "cpu"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"degrees": [1, *dps], "devices_share_host": shared,
            "note": (f"fake CPU devices of one process sharing this host's {cores} core(s): the (dp, 1) fits are "
                     f"the measured seconds per DP rank (not 1/dp of one device's)" if shared else
                     "devices of their own: the (dp, 1) fits are the measured seconds per DP rank")}


def _device_memory_bytes(platform_name: str) -> int:
    """Device memory: the first device's ``memory_stats()['bytes_limit']`` when given, else (CPU) the
    host's physical memory (``os.sysconf``)."""
    import jax
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = _parser().parse_args(argv)
    STATISTIC["name"] = args.statistic
    mbs_list = [int(x) for x in args.microbatch_sizes.split(",")]
    tps = [int(x) for x in args.tp.split(",")]
    dps = [int(x) for x in args.dp.split(",")]
    dp_mbs = [int(x) for x in args.dp_microbatch_sizes.split(",")] if args.dp_microbatch_sizes else None
    try:
        job_pids = [int(x) for x in args.job_pids.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--job-pids must be comma-separated process ids, got {args.job_pids!r}") from None
    if args.slowdown < 1 or args.repeats < 1 or min(mbs_list + tps + dps + (dp_mbs or [])) < 1 or args.seq_len < 1:
        raise SystemExit("--slowdown must be >= 1; --repeats, --seq-len, microbatch sizes, TP and DP degrees >= 1")
    pinned = _pin_profile(args) if args.pin else None
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={max(tps + dps + [4])}").strip()
    import jax

    from hethub_jax.host_allocator import steady_host_allocator
    alloc = steady_host_allocator()  # as PipelineRuntime sets it for CPU islands: calls cost the same there
    cfg = _model(args.model)
    try:
        shapes = parse_stage_shapes(args.stage_shapes, cfg.num_hidden_layers)
    except ValueError as e:
        raise SystemExit(f"--stage-shapes: {e}") from None
    # per phase: wall seconds and this process's peak / resident memory (the JSON's "phases"; a progress line each)
    log = PhaseLog(None if args.no_progress else (lambda line: print(f"profile: {line}", file=sys.stderr, flush=True)))
    bridge = bridge_ar = None
    if not args.no_bridge:
        with log.phase("bridge"):
            bridge = measure_bridge([1024, 64 * 1024, 1024 * 1024], args.repeats)
            # the bridge's all-reduce as training sums the shared gradients over it (fits.bridge_allreduce), both
            # ranks
            bridge_ar = (measure_bridge_allreduce(BRIDGE_ALLREDUCE_SIZES, max(args.repeats, 5))
                         if bridge is not None and bridge else None)
    if bridge is not None and bridge and _mpi_rank() != 0:
        return {}
    devices = jax.devices()
    platform_name = devices[0].platform
    if args.slowdown != 1 and platform_name != "cpu":
        raise SystemExit("--slowdown (emulation) applies only to cpu islands")
    t0, snap = time.perf_counter(), cpu_snapshot(job_pids, children=True)
    with log.phase("compute"):
        samples, updates = profile_compute(cfg, args.seq_len, mbs_list, tps, args.repeats, devices,
                                           not args.no_progress, dps, dp_mbs)
    if shapes:
        with log.phase("stage_shapes"):
            samples += profile_stage_shapes(cfg, args.seq_len, mbs_list, tps, args.repeats, devices, shapes)
    corun: List[dict] = []
    if args.corun == "on" or (args.corun == "auto" and platform_name == "cpu"):
        with log.phase("corun"):
            corun += measure_corun(cfg, devices, args.seq_len, args.repeats, args.corun_neighbour,
                                   None if pinned is None else pinned["neighbour_core"])
            # the updates' pair (and the tail's in the runtime) are two THREADS of this process: pinned, they would
            # share one core, which two pinned island processes do not; the predictor then slows the updates by
            # the co-run factor (DeviceCosts.corun_update_factor unset)
            if pinned is None:
                corun += measure_update_pair(cfg, devices, args.repeats)
                corun += [] if args.no_runtime else measure_tail_pair(cfg, devices, args.repeats, args.seq_len)
    with log.phase("launch"):
        corun += measure_launch(cfg, devices, args.seq_len, args.repeats)  # islands as threads: one launcher
    if not args.no_runtime:
        for name, measure in (("runtime_overhead", lambda: measure_runtime_overhead(cfg, devices, args.repeats)),
                              ("cold", lambda: measure_cold(cfg, devices, args.seq_len, args.repeats)),
                              ("in_flight", lambda: measure_in_flight(cfg, devices, args.seq_len, args.repeats)),
                              ("action_costs", lambda: measure_action_costs(cfg, devices, args.seq_len, args.repeats)),
                              ("emulated_wait", lambda: measure_emulated_wait(max(args.repeats, 20)))):
            with log.phase(name):
                corun += measure()
    cmbs = chunked_microbatch_sizes(args.chunked_mbs, mbs_list, (0, cfg.num_hidden_layers - 1) in shapes)
    if cmbs:  # heterogeneous DP's bucketed path
        with log.phase("chunked_last"):
            corun += measure_chunked_last(cfg, devices, args.seq_len, cmbs, args.repeats)
    act = args.seq_len * cfg.hidden_size * analytic.dtype_bytes(cfg.dtype)
    sizes = sorted({act * m for m in mbs_list} | {1 << 20, 8 << 20})
    if bridge is None and not args.no_runtime:  # not under mpiexec: the in-process bridge of islands as threads
        with log.phase("local_bridge"):
            corun += measure_local_bridge(sizes, args.repeats)
    with log.phase("host_copy_allreduce_shared_sum"):
        copies = measure_host_copy(devices[0], sizes, args.repeats)
        allreduce = measure_allreduce(devices[:max(tps)], sizes, args.repeats)
        copies += measure_shared_sum(cfg, devices, args.repeats, args.seq_len)
    if not args.no_runtime:  # the tied embedding's sums with the stages on every profiled mesh
        with log.phase("shared_sum_mesh"):
            copies += measure_shared_sum_mesh(cfg, devices, sorted({(1, tp) for tp in tps} | {(dp, 1) for dp in dps}),
                                              args.repeats, args.seq_len)
    prof = build_profile(cfg, args, samples, updates, copies, allreduce, bridge, platform_name, corun, bridge_ar)
    prof["others_cpu_share"] = others_share(snap, cpu_snapshot(job_pids, children=True))
    prof["others_cpu_share_excludes"] = ({"job_pids": job_pids, "note": "this job's other processes (given by "
                                          "--job-pids) are not counted as other processes"} if job_pids else None)
    prof["host_allocator"] = {"allocator": alloc["allocator"], "note": alloc["reason"]}
    prof["pinned"] = pinned
    # a caller that goes on in this process (benchmarks/hetero_e2e.py's ranks train next, one rank profiling
    # while the other waits) does not keep the profile's peak resident
    with log.phase("release_host_memory"):
        release_host_memory()
    prof["chunked_microbatch_sizes"] = list(cmbs)
    prof["phases"] = log.phases
    prof["phases_note"] = PHASES_NOTE
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(prof, fh, indent=1)
    print(f"profile of {prof['device_type']} ({len(prof['samples'])} samples, {time.perf_counter() - t0:.0f} s) "
          f"written to {args.out}" + (f"; EMULATED slowdown {args.slowdown:g}" if args.slowdown != 1 else ""))
    if (prof["others_cpu_share"] or 0) > 0.05:
        print(f"note: other processes{' (outside this job)' if job_pids else ''} used "
              f"{100 * prof['others_cpu_share']:.0f}% of this machine's CPUs while "
              f"profiling; the figures include their load (profile on an idle machine)")
    return prof


#: what a profile's ``phases`` records (``profile.main``, :class:`PhaseLog`)
PHASES_NOTE = ("per phase of the profile, in order: wall seconds; peak_rss_bytes = the process's peak resident set "
               "(VmHWM) at the phase's end, peak_rss_rise_bytes = how much the phase raised it (the phase with the "
               "largest rise holds the profile's peak), rss_bytes = resident at its end; bytes")


def _pin_profile(args: argparse.Namespace) -> Dict[str, Any]:
    """``--pin``: pins this process (every thread) to its first usable core, before the JAX backend starts, and
    returns ``{"core", "neighbour_core", "note"}`` (the profile JSON's ``pinned``; the co-run neighbour process
    pins itself to ``neighbour_core``, ``core_pinning.profile_cores``).

    Raises:
      SystemExit: without CPU affinity, with fewer than 2 usable cores, under a multi-rank launcher, or with a
        measured co-run whose neighbour is a thread (it would share the pinned core)."""
    from hethub_jax.core_pinning import local_rank_and_size, pin_threads, profile_cores
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("--pin: this system has no CPU affinity (os.sched_setaffinity)")
    where = local_rank_and_size()
    if where is not None and where[1] > 1:
        raise SystemExit(f"--pin: {where[1]} ranks of a launcher on this host would all pin to one core; profile "
                         f"one process with --pin, or let each rank pin itself (hethub_jax.train)")
    if args.corun != "off" and args.corun_neighbour != "process":
        raise SystemExit("--pin needs --corun-neighbour process (or --corun off): a neighbour thread would share "
                         "the pinned core, as two pinned island processes do not")
    try:
        core, other = profile_cores(os.sched_getaffinity(0))
    except ValueError as e:
        raise SystemExit(f"--pin: {e}") from None
    pin_threads([core])
    return {"core": core, "neighbour_core": other,
            "note": "profiler pinned to one core, its co-run neighbour process to another (--pin): calls timed on "
                    "one core; updates' co-run pair not measured (two threads would share the core)"}


def _model(name: str) -> Any:
    """A preset name or a JSON file of ``LlamaConfig`` fields."""
    from hethub_jax.models.config import LlamaConfig, get_preset
    if name.endswith(".json"):
        with open(name) as f:
            return LlamaConfig(**json.load(f))
    return get_preset(name)


def _mpi_rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--corun-child"]:  # the co-run neighbour process of measure_corun(neighbour="process")
        _corun_child(*sys.argv[2:5])
    else:
        main()
