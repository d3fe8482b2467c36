"""One pipeline stage: a layer range of the model on its own `Mesh(('dp', 'tp'))` with jitted
forward/backward functions and its own optimizer state.

Layout (Megatron-LM, Shoeybi et al. 2019, section 3): q/k/v/gate/up are column-parallel (their
output dimension -- heads or MLP width -- is split over `tp`), o/down are row-parallel (their input
dimension split), the embedding and LM head are split over the vocabulary when `tp` divides it.
With more TP shards than KV heads the KV projections are replicated. Activations are
`[microbatch, S, D]` split over `dp` on the batch dimension. XLA (GSPMD) inserts the collectives.

Gradients are *sums* over tokens (the loss of a microbatch is the summed token cross-entropy), so
accumulating them over microbatches and replicas and dividing once by the global token count gives
exactly the gradient of the global mean loss.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hethub_jax.models.config import LlamaConfig
from hethub_jax.models.llama import Llama
from hethub_jax.models.loss import token_cross_entropy
from hethub_jax.optim import clip_by_norm
from hethub_jax.parallel import multiprocess as mp
from hethub_jax.parallel import rules

Params = Any  # nested dict of arrays (nnx pure dict)


class StageInputs(NamedTuple):
    """One microbatch's inputs to a stage's compiled functions (a pytree; None fields are absent).

    Attributes:
      x: first stage: token ids `[mb, S]` int32; other stages: hidden states `[mb, S, D]` in the
        compute dtype (the previous stage's output).
      positions: `[mb, S]` int32 token positions (RoPE).
      targets: last stage only: `[mb, S]` int32 next-token ids; None elsewhere.
      mask: last stage only: `[mb, S]` float32 loss weights (0 on pads); None elsewhere.
    """

    x: Any
    positions: Any
    targets: Any = None
    mask: Any = None


class Backward(NamedTuple):
    """Result of a stage's backward on one microbatch.

    Attributes:
      acc: the gradient accumulator after adding this microbatch's parameter gradients (token sums,
        the parameters' tree and shardings).
      dx: gradient with respect to the stage input `x` (`[mb, S, D]`), None on the first stage.
    """

    acc: Any
    dx: Any


def check_tp(config: LlamaConfig, tp: int) -> None:
    """Raises ValueError if TP degree `tp` does not fit the model: `hethub_jax.parallel.rules.check_tp`,
    the rule `Plan.validate` applies too."""
    rules.check_tp(config, tp)


def logical_rules(config: LlamaConfig, tp: int) -> dict[str, str | None]:
    """Logical axis name -> mesh axis ("tp") or None (replicated), for TP degree `tp`."""
    return {
        "q_heads": "tp", "mlp": "tp",
        "kv_heads": "tp" if config.num_key_value_heads % tp == 0 else None,
        "vocab": "tp" if config.vocab_size % tp == 0 else None,
        "embed": None, "head_dim": None, "norm": None,
    }


def flat_name(path: tuple, first_layer: int) -> str:
    """nnx pure-dict path -> global flat name as `Llama.param_table` ("layers.7.mlp.up_proj")."""
    keys = [getattr(p, "key", getattr(p, "idx", p)) for p in path]
    if keys[0] == "layers":
        keys[1] = first_layer + int(keys[1])
    if keys[-1] == "weight":  # RMSNorm weights are named by their module
        keys = keys[:-1]
    return ".".join(str(k) for k in keys)


class PipelineStage:
    """Parameters, optimizer state and jitted functions of one stage.

    Args:
      config: full model config.
      first_layer, last_layer: inclusive global layer range.
      devices: the `dp * tp` JAX devices of the stage, row-major over the mesh `(dp, tp)`.
      dp, tp: mesh shape.
      seed: initialisation seed (equal seeds give the unsplit model's weights per layer).
      recompute: True: backward recomputes the forward from the saved stage input; False: it applies
        the `jax.vjp` residuals saved by the forward (more memory, less compute).
      optimizer: optax transformation for this stage's parameters.
      clip_norm: global gradient-norm clipping threshold (None: no clipping).
      debug_nan: fill unused gradient buffers with NaN (tests prove they never leak into results).

    Raises:
      ValueError: if the TP degree does not fit the model (see `check_tp`).
    """

    def __init__(self, config: LlamaConfig, first_layer: int, last_layer: int, devices: Sequence[Any],
                 dp: int, tp: int, *, seed: int, recompute: bool, optimizer, clip_norm: float | None = None,
                 debug_nan: bool = False):
        check_tp(config, tp)
        self.config, self.first_layer, self.last_layer = config, first_layer, last_layer
        self.is_first, self.is_last = first_layer == 0, last_layer == config.num_hidden_layers - 1
        self.recompute, self.debug_nan = recompute, debug_nan
        self.mesh = Mesh(np.asarray(devices, dtype=object).reshape(dp, tp), ("dp", "tp"))
        make = partial(Llama, config, first_layer=first_layer, last_layer=last_layer, seed=seed)
        self._graphdef, self._abstract = nnx.split(nnx.eval_shape(make))
        rules = logical_rules(config, tp)
        is_var = lambda x: isinstance(x, nnx.Variable)
        logical = nnx.to_pure_dict(jax.tree.map(lambda v: v.logical_axes, self._abstract, is_leaf=is_var))
        is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)
        self.param_shardings = jax.tree.map(
            lambda axes: NamedSharding(self.mesh, P(*(rules[a] for a in axes))), logical, is_leaf=is_axes)
        self.act_sharding = NamedSharding(self.mesh, P("dp", None, None))   # [mb, S, D]
        self.tok_sharding = NamedSharding(self.mesh, P("dp", None))         # [mb, S]
        # Eager initialisation on the stage's first device, then placement onto the mesh. (A jitted
        # init with out_shardings would avoid the unsharded copy; eager is much faster to start for
        # the small models this runs on today.)
        # A mesh over several processes of an island (issue 15): initialised on a device of this
        # process, then each device gets its slice of the (identical) host value.
        self.multiprocess = mp.spans_processes(devices)
        local = [d for d in devices if d.process_index == jax.process_index()]
        with jax.default_device(local[0]):
            init = nnx.to_pure_dict(nnx.split(make())[1])
        if self.multiprocess:
            self.params: Params = jax.tree.map(lambda x, s: mp.place_global(np.asarray(x), s),
                                               init, self.param_shardings)
        else:
            self.params = jax.device_put(init, self.param_shardings)
        self.optimizer, self._clip_norm = optimizer, clip_norm
        replicated = NamedSharding(self.mesh, P())
        mesh_devices = set(self.mesh.devices.flat)
        place = ((lambda x: mp.place_global(np.asarray(x), replicated)) if self.multiprocess
                 else (lambda x: jax.device_put(x, replicated)))
        self.opt_state = jax.tree.map(  # scalars (step counts) replicated on the stage mesh too
            lambda x: x if x.committed and set(x.sharding.device_set) == mesh_devices else place(x),
            optimizer.init(self.params))
        self.opt_shardings = jax.tree.map(lambda x: x.sharding, self.opt_state)
        self._abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params)
        self._build_functions()

    # ---- the pure model function ---------------------------------------------------------------
    def _apply(self, params: Params, x: jax.Array, positions: jax.Array) -> jax.Array:
        return nnx.merge(self._graphdef, params)(x, positions)

    def _stage_fn(self, params: Params, inputs: StageInputs) -> jax.Array:
        """Non-last stage: hidden `[mb, S, D]`. Last stage: summed token cross-entropy (f32 scalar)."""
        out = self._apply(params, inputs.x, inputs.positions)
        if not self.is_last:
            return jax.lax.with_sharding_constraint(out, self.act_sharding)
        return token_cross_entropy(out, inputs.targets, inputs.mask)[0]

    def _vjp(self, params: Params, inputs: StageInputs):
        """(stage output, vjp function) with respect to the parameters and, unless this is the first
        stage (token ids are not differentiable), the stage input `inputs.x`."""
        if self.is_first:
            return jax.vjp(lambda p: self._stage_fn(p, inputs), params)
        return jax.vjp(lambda p, h: self._stage_fn(p, inputs._replace(x=h)), params, inputs.x)

    def _accumulate(self, grads: tuple, acc: Params | None, first: jax.Array) -> Backward:
        """Backward(acc + param grads, or the grads alone on the first microbatch; input grads).
        `where` rather than `+` on the first microbatch: a NaN-filled buffer never leaks.
        acc None (no buffer: a one-microbatch step): the grads themselves."""
        if acc is None:
            gp = grads[0]
        else:
            gp = jax.tree.map(lambda a, g: jnp.where(first, g, a + g), acc, grads[0])
        gp = jax.lax.with_sharding_constraint(gp, self.param_shardings)
        if self.is_first:
            return Backward(gp, None)
        return Backward(gp, jax.lax.with_sharding_constraint(grads[1], self.act_sharding))

    def _forward_backward(self, params: Params, inputs: StageInputs, acc: Params | None,
                          first: jax.Array) -> tuple[jax.Array, Backward]:
        """Last stage: forward and backward of one microbatch in one jit (no residuals leave it)."""
        out, f = self._vjp(params, inputs)
        return out, self._accumulate(f(jnp.ones((), jnp.float32)), acc, first)

    def _sq_norm(self, grads: Params, inv_tokens: jax.Array) -> jax.Array:
        """Squared L2 norm (f32) of token-summed grads after division by the token count."""
        return sum(jnp.sum(jnp.square(g.astype(jnp.float32) * inv_tokens)) for g in jax.tree.leaves(grads))

    def _update(self, params: Params, opt_state: Any, grads: Params, inv_tokens: jax.Array,
                global_norm: jax.Array) -> tuple[Params, Any]:
        """grads: token-summed; divided by the global token count, clipped by the global norm.
        A non-finite global norm (NaN/inf loss or gradients) leaves params and opt_state unchanged
        (``train.on_nonfinite_loss`` then stops or skips the step)."""
        grads = jax.tree.map(lambda g: g * inv_tokens.astype(g.dtype), grads)
        grads = clip_by_norm(grads, global_norm, self._clip_norm)
        updates, new_state = self.optimizer.update(grads, opt_state, params)
        ok = jnp.isfinite(global_norm)
        keep = lambda new, old: jnp.where(ok, new, old)
        return (jax.tree.map(keep, optax.apply_updates(params, updates), params),
                jax.tree.map(keep, new_state, opt_state))

    def _forward_backward_update(self, params: Params, opt_state: Any, inputs: StageInputs,
                                 acc: Params | None, first: jax.Array, inv_tokens: jax.Array):
        """Whole-model stage of a one-stage, one-replica plan, last microbatch of the step: forward,
        backward, accumulation, global norm, clipping and the optimizer update in one program (the
        stage holds every gradient, so no norm or gradient has to leave it).
        -> (summed loss f32, global grad norm f32, new params, new opt_state)."""
        loss, grads = self._forward_backward(params, inputs, acc, first)
        norm = jnp.sqrt(self._sq_norm(grads.acc, inv_tokens))
        params, opt_state = self._update(params, opt_state, grads.acc, inv_tokens, norm)
        return loss, norm, params, opt_state

    def _build_functions(self) -> None:
        """The jitted entry points (argument names as in the methods they wrap):

        - `forward(params, inputs)` -> stage output; `forward_saving(params, inputs)` -> (output, vjp
          residuals) for `backward_saved(residuals, g, acc, first)`;
        - `backward_recompute(params, inputs, g, acc, first)` recomputes the forward from the input;
          `g` is the `[mb, S, D]` cotangent of the output, or the f32 scalar 1.0 on the last stage;
        - last stage: `forward_backward(params, inputs, acc, first)` -> (summed loss, Backward);
          one-stage plan: `forward_backward_update(params, opt_state, inputs, acc, first, inv_tokens)`;
        - `sq_norm(grads, inv_tokens)`, `update(params, opt_state, grads, inv_tokens, global_norm)`.

        Every backward returns `Backward(acc, dx)`; `acc` is donated where an output can reuse it.
        """
        ps, tok = self.param_shardings, self.tok_sharding
        last = tok if self.is_last else None
        self.inputs_sharding = StageInputs(tok if self.is_first else self.act_sharding, tok, last, last)
        in_sh = (ps, self.inputs_sharding)
        self.forward = jax.jit(self._stage_fn, in_shardings=in_sh)
        self.forward_saving = jax.jit(self._vjp, in_shardings=in_sh)

        def backward_saved(residuals, g, acc, first):
            return self._accumulate(residuals(g), acc, first)

        def backward_recompute(params, inputs, g, acc, first):
            return self._accumulate(self._vjp(params, inputs)[1](g), acc, first)
        self.backward_saved = jax.jit(backward_saved, donate_argnames="acc")
        self.backward_recompute = jax.jit(backward_recompute)
        if self.is_last:
            self.forward_backward = jax.jit(self._forward_backward, donate_argnames="acc")
        self._zeros = jax.jit(lambda: jax.tree.map(
            lambda x: jnp.full(x.shape, jnp.nan if self.debug_nan else 0, x.dtype), self._abstract_params),
            out_shardings=ps)
        self.sq_norm = jax.jit(self._sq_norm)
        self.update = jax.jit(self._update, donate_argnames=("params", "opt_state"),
                              out_shardings=(ps, self.opt_shardings))
        if self.is_first and self.is_last:
            self.forward_backward_update = jax.jit(
                self._forward_backward_update, donate_argnames=("params", "opt_state"),  # acc: no output left to reuse it
                out_shardings=(None, None, ps, self.opt_shardings))

    # ---- sharded (ZeRO-1) update ----------------------------------------------------------------
    def owned_update(self, owned: frozenset[str]):
        """The jitted `update` restricted to the parameter tensors named in ``owned`` (flat global
        names; ZeRO-1, `Plan.optimizer_sharding`): same arguments and results, but only owned
        tensors and their optimizer-state leaves (Adam moments) are computed; the others pass
        through unchanged (donated, so not copied) and their moments go stale until
        `PipelineRuntime.sync_optimizer_state`. The step counts advance as in `update`. An owned
        tensor gets exactly `update`'s arithmetic (AdamW is elementwise per tensor; the global norm
        is passed in). Compiled once per owned set.

        Raises:
          KeyError: if ``owned`` names a parameter the stage does not hold.
        """
        key = frozenset(owned)
        fns = self.__dict__.setdefault("_owned_updates", {})
        if key in fns:
            return fns[key]
        names = set(self.flat(self._abstract_params))
        if key - names:
            raise KeyError(f"stage layers {self.first_layer}..{self.last_layer} holds no {sorted(key - names)}")
        mask = self.unflat({n: n in key for n in names}, like=self._abstract_params)
        is_none = lambda x: x is None

        def update(params, opt_state, grads, inv_tokens, global_norm):
            prune = lambda t: jax.tree.map(lambda x, m: x if m else None, t, mask)
            p, g = prune(params), prune(grads)
            template = jax.eval_shape(self.optimizer.init, p)
            o = jax.tree.map(lambda t, f: None if t is None else f, template, opt_state, is_leaf=is_none)
            p, o = self._update(p, o, g, inv_tokens, global_norm)
            merge = lambda full, new: jax.tree.map(lambda a, b: a if b is None else b, full, new)
            return merge(params, p), merge(opt_state, o)
        fns[key] = jax.jit(update, donate_argnames=("params", "opt_state"),
                           out_shardings=(self.param_shardings, self.opt_shardings))
        return fns[key]

    def opt_state_names(self) -> list[tuple[str, str] | None]:
        """One entry per leaf of `opt_state` (``jax.tree.leaves`` order): (the optimizer's path to
        the parameter-shaped tree, e.g. ``"[0].mu"``, the parameter's flat global name) for a leaf
        that belongs to one parameter tensor (Adam's moments), None for a scalar (a step count)."""
        out = []
        for path, _ in jax.tree_util.tree_leaves_with_path(self.opt_state):
            i = len(path)
            while i > 0 and isinstance(path[i - 1], jax.tree_util.DictKey):
                i -= 1
            out.append((jax.tree_util.keystr(path[:i]), flat_name(path[i:], self.first_layer))
                       if i < len(path) else None)
        return out

    # ---- helpers for the runtime ---------------------------------------------------------------
    def new_grad_buffer(self) -> Params:
        """A gradient accumulator: zeros, or NaNs when `debug_nan` (first microbatch overwrites it)."""
        return self._zeros()  # filled on the device: no host->device copy of the whole tree

    def place_input(self, x: Any) -> jax.Array:
        return jax.device_put(x, self.tok_sharding if self.is_first else self.act_sharding)

    def place_tokens(self, x: Any) -> jax.Array:
        """``[mb, S]`` host rows (the whole microbatch, the same on every process) on the stage's
        token sharding; on a mesh over several processes each process places only its own rows."""
        if self.multiprocess:
            return mp.place_global(x, self.tok_sharding)
        return jax.device_put(x, self.tok_sharding)

    def flat(self, tree: Params | None = None) -> dict[str, jax.Array]:
        """Global flat names (as `Llama.param_table`) -> arrays, for params or a gradient tree."""
        tree = self.params if tree is None else tree
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return {flat_name(path, self.first_layer): leaf for path, leaf in leaves}

    def unflat(self, flat: dict[str, Any], like: Params | None = None) -> Params:
        """Inverse of `flat` (same tree structure as `like`, default the params)."""
        like = self.params if like is None else like
        paths = jax.tree_util.tree_leaves_with_path(like)
        treedef = jax.tree.structure(like)
        return jax.tree.unflatten(treedef, [flat[flat_name(p, self.first_layer)] for p, _ in paths])
