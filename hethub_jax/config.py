"""Training configuration: one YAML file with four sections, validated up front (DESIGN.md section 11).

```yaml
model: tiny                    # preset name, or {preset: tiny, <LlamaConfig field>: value, ...},
                               # or a full mapping of LlamaConfig fields
data:  {seq_len: 128, ...}     # hethub_jax.data.DataConfig
optim: {learning_rate: 3e-3}   # hethub_jax.optim.OptimConfig (decay_steps defaults to train.steps)
train: {steps: 200, ...}       # TrainSettings below
```

Every section is optional (defaults train the ``tiny`` preset on the Shakespeare corpus on CPU in a
few minutes). Every field is documented in ``configs/tiny.yaml`` and ``docs/training.md``.

Precedence, lowest first: field defaults < the YAML file < ``--set SECTION.FIELD=VALUE`` overrides
< dedicated command-line flags (``--steps``, ``--plan``, ...), applied by :func:`load_config`.

Every error is a :class:`ConfigError` (a ``ValueError``) whose message names the section and field
(``train.microbatch_size``) and the constraint, raised before any JAX computation. Nothing here
compiles or allocates arrays; importing this module imports jax (through the model config).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import yaml

from hethub_jax.data import DataConfig
from hethub_jax.models.config import PRESETS, LlamaConfig, get_preset
from hethub_jax.optim import OptimConfig

__all__ = ["ConfigError", "TrainSettings", "TrainConfig", "SECTIONS", "load_config", "parse_override",
           "build_model_config", "DEFAULT_BATCH_SIZE"]

SECTIONS = ("model", "data", "optim", "train")
DEFAULT_BATCH_SIZE = 16  # global batch (samples) when neither the config nor a plan gives one


class ConfigError(ValueError):
    """A configuration error; the message names ``section.field`` and the violated constraint."""


@dataclass(frozen=True)
class TrainSettings:
    """The ``train`` section: the training loop, its outputs and the parallel plan.

    Attributes:
      steps: optimizer steps to run (>= 1).
      global_batch_size: samples (rows of ``data.seq_len`` tokens) per optimizer step; ``None``: the
        plan's value, or 16 when no plan is given. A number overrides the plan's value.
      microbatch_size: samples per microbatch; ``None``: the plan's value, or the global batch (one
        microbatch) when no plan is given. Must divide ``global_batch_size``.
      eval_every: evaluate the validation loss every this many steps (>= 1) and at the last step.
      eval_at_start: also evaluate before the first step (recorded as step 0).
      eval_batches: fixed validation batches (of ``global_batch_size`` rows each, the first ones of
        the validation split) per evaluation; ``None``: the whole validation split.
      log_every: print a plain text line every this many steps (0: only at evaluations); the
        progress bar is updated every step regardless.
      seed: parameter initialisation seed (the data shuffle seed is ``data.seed``).
      metrics_file: JSON-lines metrics path (``None``: none written). Truncated at the start of a
        run, appended to when resuming.
      checkpoint_dir: orbax checkpoints go to ``checkpoint_dir/step_{N}/rank_{R}/`` (``None``: none).
      checkpoint_every: also checkpoint every this many steps (0: only at the end).
      resume: continue from the newest complete checkpoint in ``checkpoint_dir`` (parameters,
        optimizer state and data position), if there is one.
      plan: path of a plan JSON (``docs/plan_format.md``); ``None``: one island ``main`` on the
        local JAX platform, one stage with all layers on one device, schedule ``1f1b``.
      trace_file: write a Chrome trace (Perfetto) of the last step's actions here (``None``: none).
    """

    steps: int = 200
    global_batch_size: int | None = None
    microbatch_size: int | None = None
    eval_every: int = 50
    eval_at_start: bool = True
    eval_batches: int | None = 8
    log_every: int = 50
    seed: int = 0
    metrics_file: str | None = "runs/tiny/metrics.jsonl"
    checkpoint_dir: str | None = "runs/tiny/checkpoints"
    checkpoint_every: int = 0
    resume: bool = False
    plan: str | None = None
    trace_file: str | None = None

    def __post_init__(self) -> None:
        _pos_int("train.steps", self.steps)
        for name in ("global_batch_size", "microbatch_size", "eval_batches"):
            if getattr(self, name) is not None:
                _pos_int(f"train.{name}", getattr(self, name))
        _pos_int("train.eval_every", self.eval_every)
        for name in ("log_every", "checkpoint_every", "seed"):
            _nonneg_int(f"train.{name}", getattr(self, name))
        for name in ("eval_at_start", "resume"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"train.{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("metrics_file", "checkpoint_dir", "plan", "trace_file"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ConfigError(f"train.{name} must be a non-empty path string or null, got {v!r}")
        g, m = self.global_batch_size, self.microbatch_size
        if g is not None and m is not None and g % m:
            raise ConfigError(f"train.global_batch_size must be divisible by train.microbatch_size: "
                              f"{g} % {m} = {g % m}")
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError("train.resume needs train.checkpoint_dir (null given)")


@dataclass(frozen=True)
class TrainConfig:
    """The whole validated configuration.

    Attributes:
      model: the model architecture.
      model_spec: the ``model`` section as written (preset name or mapping), for the run record.
      data: corpus, tokenizer, sequence length and split (``hethub_jax.data.DataConfig``).
      optim: optimizer (``hethub_jax.optim.OptimConfig``); ``decay_steps`` is ``train.steps``
        unless the file sets it.
      train: the training loop (:class:`TrainSettings`).
    """

    model: LlamaConfig
    model_spec: Any
    data: DataConfig
    optim: OptimConfig
    train: TrainSettings

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (the run record of the metrics file); ``model`` is the resolved
        architecture, ``model_spec`` what the file said."""
        return {"model": self.model.to_dict(), "model_spec": _plain(self.model_spec),
                "data": dataclasses.asdict(self.data), "optim": dataclasses.asdict(self.optim),
                "train": dataclasses.asdict(self.train)}


# --------------------------------------------------------------------------------------------------
# validation helpers

def _pos_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    return v


def _nonneg_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
    return v


def _yaml11_float(v: Any) -> Any:
    """YAML 1.1 (PyYAML) reads ``3e-3`` (no dot) as a string; accept it as the number it means."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _section(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    v = raw.get(name)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ConfigError(f"section {name!r} must be a mapping of fields, got {type(v).__name__}: {v!r}")
    return dict(v)


def _check_keys(section: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    allowed = list(allowed)
    for k in given:
        if k not in allowed:
            raise ConfigError(f"unknown key {k!r} in section {section!r}; allowed keys: {sorted(allowed)}")


def _wrap(section: str, fn, *args):
    """Call a constructor, turning its ValueError/TypeError into a ConfigError naming the section."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        msg = str(e)
        prefix = f"{section}."
        raise ConfigError(msg if msg.startswith(prefix) else f"{section}: {msg}") from None


def build_model_config(spec: Any) -> LlamaConfig:
    """The ``model`` section -> :class:`LlamaConfig`.

    ``spec`` is a preset name (``"tiny"``), a mapping ``{preset: NAME, <field>: value, ...}`` (the
    preset with those fields replaced), or a mapping of :class:`LlamaConfig` fields (defaults for
    the rest).

    Raises:
      ConfigError: unknown preset or field, or a value the model config rejects.
    """
    if spec is None:
        spec = "tiny"
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ConfigError(f"model: unknown preset {spec!r}; known presets: {sorted(PRESETS)}")
        return get_preset(spec)
    if not isinstance(spec, Mapping):
        raise ConfigError(f"model must be a preset name or a mapping, got {type(spec).__name__}: {spec!r}")
    fields = dict(spec)
    preset = fields.pop("preset", None)
    _check_keys("model", fields, [f.name for f in dataclasses.fields(LlamaConfig)])
    if preset is None:
        return _wrap("model", LlamaConfig.from_dict, fields)
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {preset!r}; known presets: {sorted(PRESETS)}")
    base = get_preset(preset).to_dict()
    base.update(fields)
    if "num_attention_heads" in fields and "num_key_value_heads" not in fields \
            and base["num_key_value_heads"] > fields["num_attention_heads"]:
        base["num_key_value_heads"] = None  # do not keep a preset KV count above the new head count
    if "hidden_size" in fields or "num_attention_heads" in fields:
        if "head_dim" not in fields:
            base["head_dim"] = None  # recompute from the new width / heads
    return _wrap("model", LlamaConfig.from_dict, base)


# --------------------------------------------------------------------------------------------------
# overrides

def parse_override(text: str) -> tuple[str, str, Any]:
    """``"SECTION.FIELD=VALUE"`` -> ``(section, field, value)``; VALUE is parsed as YAML
    (``3e-3`` -> float, ``null`` -> None, ``tiny`` -> str). ``model=NAME`` sets the model section.

    Raises:
      ConfigError: malformed text or unknown section.
    """
    key, sep, value = text.partition("=")
    if not sep:
        raise ConfigError(f"override {text!r} must look like SECTION.FIELD=VALUE")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from None
    section, _, field = key.strip().partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"override {text!r}: unknown section {section!r}; sections: {list(SECTIONS)}")
    if not field and section != "model":
        raise ConfigError(f"override {text!r} must name a field: {section}.FIELD=VALUE")
    return section, field, parsed


def _apply_override(raw: dict[str, Any], section: str, field: str, value: Any) -> None:
    if section == "model" and not field:
        raw["model"] = value
        return
    current = raw.get(section)
    if section == "model" and isinstance(current, str):
        current = {"preset": current}
    if current is None:
        current = {"preset": "tiny"} if section == "model" else {}
    if not isinstance(current, Mapping):
        raise ConfigError(f"cannot override {section}.{field}: section {section!r} is not a mapping")
    current = dict(current)
    current[field] = value
    raw[section] = current


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a config file. Raises ConfigError for a missing or unreadable file, invalid YAML, a top
    level that is not a mapping, or an unknown section."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config: file not found: {os.fspath(path)}") from None
    except OSError as e:
        raise ConfigError(f"--config: cannot read {os.fspath(path)}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {os.fspath(path)}: invalid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"--config {os.fspath(path)}: the top level must be a mapping with sections "
                          f"{list(SECTIONS)}, got {type(raw).__name__}")
    _check_keys_top(raw, os.fspath(path))
    return dict(raw)


def _check_keys_top(raw: Mapping[str, Any], where: str) -> None:
    for k in raw:
        if k not in SECTIONS:
            raise ConfigError(f"unknown section {k!r} in {where}; sections: {list(SECTIONS)}")


# --------------------------------------------------------------------------------------------------

def from_dict(raw: Mapping[str, Any]) -> TrainConfig:
    """Validate a raw config (the parsed YAML) into a :class:`TrainConfig`.

    Raises:
      ConfigError: for an unknown section or key (naming both) or an invalid value (naming the
        field and the constraint), including the cross-section rules: ``data.seq_len`` <=
        ``model.max_position_embeddings``.
    """
    _check_keys_top(raw, "config")
    model = build_model_config(raw.get("model", "tiny"))

    data_d = _section(raw, "data")
    _check_keys("data", data_d, [f.name for f in dataclasses.fields(DataConfig)])
    data = _wrap("data", DataConfig.from_dict, data_d)

    train_d = _section(raw, "train")
    _check_keys("train", train_d, [f.name for f in dataclasses.fields(TrainSettings)])
    train = _wrap("train", lambda d: TrainSettings(**d), train_d)

    optim_d = _section(raw, "optim")
    _check_keys("optim", optim_d, [f.name for f in dataclasses.fields(OptimConfig)])
    if optim_d.get("decay_steps") is None:
        optim_d["decay_steps"] = train.steps
    for name in ("warmup_steps", "decay_steps"):
        v = optim_d.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ConfigError(f"optim.{name} must be an integer, got {v!r}")
    for name in ("learning_rate", "min_lr_ratio", "weight_decay", "b1", "b2", "eps", "grad_clip_norm"):
        if name not in optim_d:
            continue
        v = optim_d[name] = _yaml11_float(optim_d[name])
        if v is None and name != "grad_clip_norm":
            raise ConfigError(f"optim.{name} must be a finite number, got null")
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ConfigError(f"optim.{name} must be a finite number, got {v!r}")
    optim = _wrap("optim", OptimConfig.from_dict, optim_d)

    if data.seq_len > model.max_position_embeddings:
        raise ConfigError(f"data.seq_len ({data.seq_len}) must be <= model.max_position_embeddings "
                          f"({model.max_position_embeddings})")
    return TrainConfig(model=model, model_spec=raw.get("model", "tiny"), data=data, optim=optim,
                       train=train)


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = (),
                flags: Mapping[str, Any] | None = None) -> TrainConfig:
    """Read ``path`` (``None``: defaults only), apply ``--set`` ``overrides`` then dedicated
    ``flags`` (``{"train.steps": 10, ...}``; a ``None`` value means "flag not given"), validate.

    Raises:
      ConfigError: see :func:`from_dict`, :func:`read_yaml`, :func:`parse_override`.
    """
    raw = read_yaml(path) if path is not None else {}
    for text in overrides:
        _apply_override(raw, *parse_override(text))
    for key, value in (flags or {}).items():
        if value is not None:
            section, _, field = key.partition(".")
            _apply_override(raw, section, field, value)
    return from_dict(raw)
