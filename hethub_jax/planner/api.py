"""Python API of the planner for scripts: load a model and a cluster, ask for plans, ask what-if questions.

Every figure returned is PREDICTED (``hethub_jax.planner.predictor``), not measured. Example::

    from hethub_jax import planner
    res = planner.plan("llama-140b", "configs/clusters/hethub_768.yaml", global_batch=1536, seq_len=4096)
    print(res.best.step_time_s, res.best.plan.to_json())
    gain = planner.what_if_add_nodes("llama-140b", "configs/clusters/hethub_768.yaml", "mi250x", 16,
                                     global_batch=1536, seq_len=4096)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Union

from hethub_jax.planner.cluster import ClusterSpec, load_cluster
from hethub_jax.planner.search import DEFAULT_TOP_K, Candidate, PlanningError, SearchOptions, SearchResult, search

__all__ = ["load_model", "plan", "what_if_add_nodes", "what_if_add_group", "lm_head_placement", "WhatIf",
           "default_seq_len", "config_seq_len"]

#: LlamaConfig fields (HF meanings), used to apply overrides to a preset through the public constructor
_MODEL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
                 "max_position_embeddings", "tie_word_embeddings", "initializer_range", "dtype", "param_dtype")


def _read_config_file(path: Union[str, os.PathLike]) -> Any:
    """A ``.json`` file read as JSON (YAML 1.1 would read JSON's ``1e-05`` as a string), anything else as
    YAML."""
    with open(path) as f:
        if str(path).lower().endswith(".json"):
            return json.load(f)
        import yaml
        return yaml.safe_load(f)


def load_model(model: Any):
    """A ``LlamaConfig`` from a preset name (``hethub_jax.models.config.PRESETS``), a YAML/JSON file (a
    training config's ``model`` section, or the model mapping itself: ``{preset: NAME, field: value}``
    or every field), a mapping of that form, or a ``LlamaConfig`` (returned as is).

    Raises:
      ValueError: for an unknown preset or field, or a file that is neither.
    """
    from hethub_jax.models.config import LlamaConfig, get_preset
    if isinstance(model, str) and not os.path.exists(model):
        if model.lower().endswith((".yaml", ".yml", ".json")) or os.sep in model:
            raise ValueError(f"model config file not found: {model} (--model takes a preset name or a "
                             f"YAML/JSON file)")
        return get_preset(model)
    if isinstance(model, (str, os.PathLike)):
        data = _read_config_file(model)
        if isinstance(data, Mapping) and "model" in data:
            data = data["model"]
        return load_model(data)
    if isinstance(model, Mapping):
        d = dict(model)
        if "preset" in d:
            base = get_preset(d.pop("preset"))
            unknown = sorted(set(d) - set(_MODEL_FIELDS))
            if unknown:
                raise ValueError(f"unknown model field(s) {unknown}; known: {list(_MODEL_FIELDS)}")
            fields = {k: getattr(base, k) for k in _MODEL_FIELDS}
            fields.update(d)
            if "head_dim" not in d and ("hidden_size" in d or "num_attention_heads" in d):
                fields["head_dim"] = None
            if fields.get("rope_scaling") is not None:
                fields["rope_scaling"] = dict(fields["rope_scaling"])
            return LlamaConfig(**fields)
        return LlamaConfig(**d)
    if hasattr(model, "num_hidden_layers"):
        return model
    raise ValueError(f"model must be a preset name, a config file, a mapping or a LlamaConfig, got {model!r}")


def default_seq_len(cfg: Any) -> int:
    """4096 tokens, or the model's ``max_position_embeddings`` when smaller: the planner's default for a
    model given as a preset or a model mapping (a training config file gives its own, see
    :func:`config_seq_len`). Not training's default (``data.seq_len`` 128): planning a real model at 128
    tokens per sample would rank plans for a workload nobody trains; the plan records the length it was
    made for (``Plan.seq_len``) and ``python -m hethub_jax.train --plan`` checks it."""
    return int(min(4096, cfg.max_position_embeddings))


def config_seq_len(model: Any) -> Optional[int]:
    """The training sequence length of ``model`` when it is a training config file (a YAML/JSON file
    with a top-level ``model`` key): its ``data.seq_len``, or ``DataConfig``'s default (128) when the
    file gives none, i.e. what ``python -m hethub_jax.train --config FILE`` trains with. None for a
    preset name, a model mapping or a file holding only the model."""
    if not isinstance(model, (str, os.PathLike)) or not os.path.isfile(model):
        return None
    data = _read_config_file(model)
    if not (isinstance(data, Mapping) and "model" in data):
        return None
    from hethub_jax.data.config import DataConfig
    data_section = data.get("data")
    seq = data_section.get("seq_len") if isinstance(data_section, Mapping) else None
    return int(seq) if seq is not None else int(DataConfig.model_fields["seq_len"].default)


def plan(model: Any, cluster: Union[str, os.PathLike, Mapping[str, Any], ClusterSpec], global_batch: int,
         seq_len: Optional[int] = None, *, top_k: int = DEFAULT_TOP_K, profiles_dir: Optional[str] = None,
         upper_bound: bool = True, split: bool = True, **options: Any) -> SearchResult:
    """Search the plans of ``model`` on ``cluster`` for ``global_batch`` samples of ``seq_len`` tokens
    (default: a training config file's ``data.seq_len`` (:func:`config_seq_len`), else
    :func:`default_seq_len`); ``options`` are :class:`SearchOptions` fields, e.g. ``memory_headroom``
    (fraction of each device's memory kept free, default 0.05). Every plan records ``seq_len``. ``split`` (default):
    candidates with several stages on a multi-node group come with that group split into one island
    per stage and predicted again, so that today's runtime runs them (``planner.runnable``); False:
    the plans as searched (one island per group).

    Raises:
      ValueError: bad input (naming it). PlanningError: no plan fits (naming the binding constraint).
    """
    from hethub_jax.planner.runnable import runnable_result
    cfg = load_model(model)
    opt = SearchOptions(top_k=top_k, **options)
    seq = seq_len or config_seq_len(model) or default_seq_len(cfg)
    res = search(cfg, load_cluster(cluster), global_batch, seq, options=opt, profiles_dir=profiles_dir,
                 upper_bound=upper_bound and not split)
    if not split:
        return res
    return runnable_result(res, cfg, cluster, seq, options=opt, profiles_dir=profiles_dir, upper_bound=upper_bound)


@dataclass(frozen=True)
class WhatIf:
    """A what-if comparison, PREDICTED: the best plan before and after a change of the cluster.

    Attributes:
      before, after: the best candidates; speedup: ``after.tokens_per_s / before.tokens_per_s``.
      cluster_after: the changed cluster spec.
    """

    before: Candidate
    after: Candidate
    speedup: float
    cluster_after: ClusterSpec


def what_if_add_nodes(model: Any, cluster: Any, group: str, extra_nodes: int, global_batch: int,
                      seq_len: Optional[int] = None, **kw: Any) -> WhatIf:
    """How much faster (tokens/s) does the cluster train if group ``group`` gets ``extra_nodes`` more nodes?

    Raises:
      ValueError: for an unknown group or a node count below 1.
    """
    c = load_cluster(cluster)
    after = c.with_group(group, nodes=c.group(group).nodes + int(extra_nodes))
    return _compare(model, c, after, global_batch, seq_len, **kw)


def what_if_add_group(model: Any, cluster: Any, global_batch: int, seq_len: Optional[int] = None, *,
                      group: Mapping[str, Any], **kw: Any) -> WhatIf:
    """How much faster does the cluster train with one more node group (``group``: NodeGroup fields)?"""
    c = load_cluster(cluster)
    return _compare(model, c, c.add_group(**dict(group)), global_batch, seq_len, **kw)


def _compare(model: Any, before: ClusterSpec, after: ClusterSpec, global_batch: int, seq_len: Optional[int],
             **kw: Any) -> WhatIf:
    kw.setdefault("upper_bound", False)
    b = plan(model, before, global_batch, seq_len, **kw).best
    a = plan(model, after, global_batch, seq_len, **kw).best
    return WhatIf(b, a, a.tokens_per_s / b.tokens_per_s, after)


def lm_head_placement(model: Any, cluster: Any, global_batch: int, seq_len: Optional[int] = None,
                      **kw: Any) -> Dict[str, Optional[Candidate]]:
    """Which device type should hold the LM head? Per group, the best PIPELINE plan whose last stage
    (final norm, LM head and loss) runs on that group, or None when none fits."""
    c = load_cluster(cluster)
    kw.setdefault("upper_bound", False)
    out: Dict[str, Optional[Candidate]] = {}
    for g in c.groups:
        try:
            out[g.name] = plan(model, c, global_batch, seq_len, last_group=g.name, hetero_dp=False, **kw).best
        except PlanningError:
            out[g.name] = None
    return out
