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
compiles or allocates arrays; importing this module imports jax (through ``hethub_jax.optim``).
The sections are frozen, strict pydantic models (``hethub_jax.typed``); their JSON Schema is
``docs/schema/config.schema.json`` (``python -m hethub_jax.schema``).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Iterable, Literal, Mapping, Optional

import yaml
from pydantic import Field, StringConstraints, field_validator, model_validator

from hethub_jax.data import DataConfig
from hethub_jax.models.config import PRESETS, LlamaConfig, get_preset
from hethub_jax.optim import OptimConfig
from hethub_jax.parallel.rules import check_batch
from hethub_jax.typed import StrictModel, validate_model

__all__ = ["ConfigError", "TrainSettings", "TrainConfig", "SECTIONS", "load_config", "parse_override",
           "build_model_config", "DEFAULT_BATCH_SIZE"]

SECTIONS = ("model", "data", "optim", "train")
DEFAULT_BATCH_SIZE = 16  # global batch (samples) when neither the config nor a plan gives one

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PathStr = Annotated[str, StringConstraints(min_length=1)]


class ConfigError(ValueError):
    """A configuration error; the message names ``section.field`` and the violated constraint."""


class TrainSettings(StrictModel):
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
      metrics_file: JSON-lines metrics path (``None``: none written). Appended to when resuming; a run
        that starts from step 0 never truncates an earlier run's file: it renames it to
        ``<metrics_file>.<N>`` (the first free N >= 1, said at start) and starts a new one.
      checkpoint_dir: orbax checkpoints go to ``checkpoint_dir/step_{N}/{unit}/`` (``None``: none;
        layout in ``hethub_jax.checkpoint``).
      checkpoint_every: also checkpoint every this many steps (0: only at the end).
      resume: ``None`` (default, as MaxText): continue from the newest complete checkpoint in
        ``checkpoint_dir`` when it holds one, else start from step 0 (either way said at start).
        ``True``: continue from it (parameters, optimizer state and data position), under this run's
        plan (which may differ from the plan the checkpoint was written under); no complete
        checkpoint is an error unless ``resume_or_start``. ``False``: start from step 0; the earlier
        run's ``step_*`` directories are moved into ``checkpoint_dir/earlier_run_<N>/`` (said at
        start) so that a later resume never picks one of them up.
      resume_or_start: with ``resume``, start from step 0 when there is no complete checkpoint.
      keep_checkpoints: complete checkpoints kept in ``checkpoint_dir`` (older ones are deleted);
        ``None``: all.
      message_timeout_s: seconds a rank waits for a message from another rank (an activation,
        gradient or collective) before it fails naming the peer rank and island.
      on_nonfinite_loss: ``stop``: end the run (exit status 1) at a non-finite loss; ``skip``: leave
        parameters and optimizer state as they were and go on with the next batch. Either way the
        step's update is never applied and never reaches a checkpoint.
      plan: path of a plan JSON (``docs/plan_format.md``); ``None``: one island ``main`` on the
        local JAX platform, one stage with all layers on one device, schedule ``1f1b``.
      trace_file: write a Chrome trace (Perfetto) of the last step's actions here (``None``: none).
      grad_bucket_mb: heterogeneous DP: the gradient all-reduce across replicas. ``auto`` (default):
        a warm-up after the batch shares are set times a few steps' forward/backward with the
        all-reduce in buckets of 25 MiB and with the all-reduce after the whole backward (3 timed
        passes of each, interleaved, after one compiling pass each; no update applied) and keeps the
        faster (``hethub_jax.parallel.plan.keeps_bucketed_allreduce``), printing both MEASURED seconds
        (EMULATED slowdowns included where the plan has them). Why measured: which path wins depends
        on the shares and the islands (docs/benchmarks.md, issues 5 and 17.5: bucketed ahead in session
        8's quiet runs, after the backward ahead in sessions 13-14's). A number: always in buckets of
        this many MiB, overlapped with the backward (as PyTorch DDP's ``bucket_cap_mb``, whose
        default is 25; the first bucket is 1 MiB or this if smaller). ``None``: always after the
        whole backward. Both paths give the same sums. Only plans of several one-stage replicas can
        bucket; other plans ignore it (the banner says why).

    Raises:
      ValueError: on construction, naming the field and the constraint (through :func:`from_dict`:
        a :class:`ConfigError` naming ``train.<field>``).
    """

    steps: PositiveInt = 200
    global_batch_size: Optional[PositiveInt] = None
    microbatch_size: Optional[PositiveInt] = None
    eval_every: PositiveInt = 50
    eval_at_start: bool = True
    eval_batches: Optional[PositiveInt] = 8
    log_every: NonNegativeInt = 50
    seed: NonNegativeInt = 0
    metrics_file: Optional[PathStr] = "runs/tiny/metrics.jsonl"
    checkpoint_dir: Optional[PathStr] = "runs/tiny/checkpoints"
    checkpoint_every: NonNegativeInt = 0
    resume: Optional[bool] = None
    resume_or_start: bool = False
    keep_checkpoints: Optional[PositiveInt] = 3
    message_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    on_nonfinite_loss: Literal["stop", "skip"] = "stop"
    plan: Optional[PathStr] = None
    trace_file: Optional[PathStr] = None
    grad_bucket_mb: Optional[Annotated[float, Field(gt=0)] | Literal["auto"]] = "auto"

    @field_validator("grad_bucket_mb", mode="before")
    @classmethod
    def _bucket_mb(cls, v: Any) -> Any:
        if v is None or (isinstance(v, str) and v == "auto"):
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"grad_bucket_mb must be a number of MiB > 0, 'auto' (measure bucketed against "
                             f"unbucketed in a warm-up) or null (unbucketed), got {v!r}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "TrainSettings":
        if self.global_batch_size is not None and self.microbatch_size is not None:
            check_batch(self.global_batch_size, self.microbatch_size, prefix="train.")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("train.resume needs train.checkpoint_dir (null given)")
        return self


class TrainConfig(StrictModel):
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
                "data": self.data.model_dump(), "optim": self.optim.model_dump(),
                "train": self.train.model_dump()}


# --------------------------------------------------------------------------------------------------
# validation helpers

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


def _validate(model: type, section: str, fields: Mapping[str, Any]):
    """``model`` from a section's fields (YAML: ``3e-3`` is a float); a ConfigError naming
    ``section.field`` or ``unknown key ... in section '...'``."""
    return validate_model(model, fields, root=section, container=f"section {section!r}", cls=ConfigError,
                          yaml=True)


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
    if preset is None:
        return _validate(LlamaConfig, "model", fields)
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {preset!r}; known presets: {sorted(PRESETS)}")
    base = get_preset(preset).to_dict()
    base.update(fields)
    if "num_attention_heads" in fields and isinstance(fields["num_attention_heads"], int) and "num_key_value_heads" not in fields \
            and base["num_key_value_heads"] > fields["num_attention_heads"]:
        base["num_key_value_heads"] = None  # do not keep a preset KV count above the new head count
    if "hidden_size" in fields or "num_attention_heads" in fields:
        if "head_dim" not in fields:
            base["head_dim"] = None  # recompute from the new width / heads
    return _validate(LlamaConfig, "model", base)


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

    data = _validate(DataConfig, "data", _section(raw, "data"))
    train = _validate(TrainSettings, "train", _section(raw, "train"))
    optim_d = _section(raw, "optim")
    if optim_d.get("decay_steps") is None:
        optim_d["decay_steps"] = train.steps
    optim = _validate(OptimConfig, "optim", optim_d)

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
