"""Adapter over XLA's cost and memory analyses (the one planner module that uses JAX, lazily).

``jax.stages.Lowered.cost_analysis()`` / ``Compiled.cost_analysis()`` return, depending on the JAX
version and backend, a dict, a list holding one dict (one per device program, older versions) or
None (backend without the analysis); individual entries may be missing, -1 or 0 (unknown). This
module turns any of those into one :class:`XlaCost`, and falls back to an analytic FLOP count
(``hethub_jax.planner.analytic``) when XLA's figure is missing, non-positive, or more than 2x away from
it -- and says so (``fallback`` is True, ``notice`` explains, and a ``UserWarning`` is issued).

Under sharding (``jax.jit`` with shardings over a mesh), XLA analyses ONE device's program (SPMD
partitioned): FLOPs, bytes and memory are PER DEVICE. Compare them with the analytic count of the
whole computation divided by the number of shards doing the work (pass ``num_shards``).

No JAX is imported at module level: ``import hethub_jax.planner.xla_cost`` works without JAX; only
:func:`analyze` / :func:`memory_of` touch the JAX objects they are handed.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["XlaCost", "normalize_cost_analysis", "cost_from_analysis", "analyze", "memory_of"]

#: XLA's figure may differ from the analytic count by at most this factor before it is replaced
MAX_RATIO = 2.0


@dataclass(frozen=True)
class XlaCost:
    """FLOPs and bytes of one computation, per device.

    Attributes:
      flops: floating-point operations (count), per device.
      bytes_accessed: bytes read and written (XLA's estimate), per device; None when unknown.
      xla_flops: XLA's own FLOP figure as reported (None when missing or not positive).
      fallback: True when ``flops`` is the analytic count instead of XLA's.
      notice: why the fallback was taken ("" when not).
    """

    flops: float
    bytes_accessed: Optional[float]
    xla_flops: Optional[float]
    fallback: bool
    notice: str = ""


def normalize_cost_analysis(raw: Any) -> Optional[Mapping[str, Any]]:
    """The cost analysis as one mapping: a dict as is, the first element of a list/tuple of dicts
    (older JAX versions return ``[dict]``), None for None or an empty list.

    Raises:
      TypeError: for any other type.
    """
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        return raw
    if isinstance(raw, (list, tuple)):
        if not raw:
            return None
        if not isinstance(raw[0], Mapping):
            raise TypeError(f"cost analysis list holds {type(raw[0]).__name__}, expected a dict")
        return raw[0]
    raise TypeError(f"cost analysis must be a dict, a list of dicts or None, got {type(raw).__name__}")


def _positive(v: Any) -> Optional[float]:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def cost_from_analysis(raw: Any, analytic_flops: Optional[float], *, warn: bool = True) -> XlaCost:
    """An :class:`XlaCost` from a raw ``cost_analysis()`` result (dict, ``[dict]`` or None).

    Args:
      raw: what ``cost_analysis()`` returned.
      analytic_flops: the analytic FLOP count of the same computation PER DEVICE (e.g.
        ``analytic.layer_flops(...) / tp``); None when there is none to compare with.
      warn: issue a ``UserWarning`` with the notice when falling back.

    Returns:
      XLA's ``flops`` when positive and (if ``analytic_flops`` is given) within a factor
      :data:`MAX_RATIO` of it; otherwise the analytic count with ``fallback=True``.
    Raises:
      ValueError: if XLA gives no usable figure and ``analytic_flops`` is None.
    """
    d = normalize_cost_analysis(raw)
    xla = _positive(d.get("flops")) if d is not None else None
    nbytes = _positive(d.get("bytes accessed")) if d is not None else None
    notice = ""
    if xla is None:
        notice = ("XLA cost analysis unavailable" if d is None else
                  f"XLA reported flops={d.get('flops')!r} (missing or not positive)")
    elif analytic_flops is not None and analytic_flops > 0:
        ratio = xla / analytic_flops
        if not 1 / MAX_RATIO <= ratio <= MAX_RATIO:
            notice = (f"XLA reported {xla:.4g} FLOPs, {ratio:.3g}x the analytic {analytic_flops:.4g} "
                      f"(more than {MAX_RATIO:g}x off)")
    if not notice:
        return XlaCost(xla, nbytes, xla, False)
    if analytic_flops is None:
        raise ValueError(f"{notice}, and no analytic FLOP count to fall back to")
    notice += "; using the analytic count"
    if warn:
        warnings.warn(notice, UserWarning, stacklevel=2)
    return XlaCost(float(analytic_flops), nbytes, xla, True, notice)


def analyze(stage: Any, analytic_flops: Optional[float], *, warn: bool = True) -> XlaCost:
    """:func:`cost_from_analysis` of a ``jax.stages.Lowered`` or ``Compiled`` object (anything with
    ``cost_analysis()``); an exception inside ``cost_analysis()`` counts as "unavailable"."""
    try:
        raw = stage.cost_analysis()
    except Exception as e:  # some backends raise instead of returning None
        warnings.warn(f"cost_analysis() raised {type(e).__name__}: {e}", UserWarning, stacklevel=2)
        raw = None
    return cost_from_analysis(raw, analytic_flops, warn=warn)


def memory_of(compiled: Any) -> Optional[dict]:
    """Per-device memory of a compiled computation from ``memory_analysis()``: a dict with
    ``argument``, ``output``, ``temp``, ``alias`` and ``generated_code`` bytes (missing fields 0), or
    None when the backend gives no analysis."""
    try:
        ma = compiled.memory_analysis()
    except Exception:
        return None
    if ma is None:
        return None
    if isinstance(ma, (list, tuple)):
        ma = ma[0] if ma else None
        if ma is None:
            return None
    get = lambda name: int(getattr(ma, name, 0) or 0)
    return {"argument": get("argument_size_in_bytes"), "output": get("output_size_in_bytes"),
            "temp": get("temp_size_in_bytes"), "alias": get("alias_size_in_bytes"),
            "generated_code": get("generated_code_size_in_bytes")}
