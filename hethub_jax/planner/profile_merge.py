"""Median of several profiles of one device type, figure by figure (plain Python: no JAX, no numpy).

Why (docs/benchmarks.md, issue 13, session 16): on a shared VM one profile is one draw of the machine's speed over
the minutes it ran; two quiet runs of the same code gave profiles ~5% apart. Several profiles made at different
times (e.g. ``benchmarks/predictor_accuracy.py --profile-processes 3``, one profile process between rounds) and
merged here give every figure the median of its draws.

::

    python -m hethub_jax.planner.profile_merge --out merged.json a.json b.json c.json

Rule (:func:`merge_profiles`): the profiles must be of the same thing (same ``format``, device type, model,
sequence length, statistic, emulated slowdown, platform); samples are matched by what they measured
(:func:`sample_key`: their non-float fields), so a profile made with fewer parts (``--corun off``, ``--no-runtime``)
merges too, its missing samples and fits taken from the others. Then, in ``samples`` and ``fits``, every number (``int`` or ``float``, not ``bool``) is the median of that number
over the profiles (``statistics.median``: the middle value, or the mean of the two middle values for an even
count), and every other value (strings, booleans, None) is the first profile's. For a fitted line that is the
median of each coefficient (not the line through the median samples). A number that is None or missing in some
profiles (a fit that one profile could not make) is the median of the profiles that have it; a list whose length
differs between profiles is the first profile's. Every such path is listed in ``merged.differing``. Other top-level
keys are the first profile's; ``others_cpu_share`` is the median, and ``merged`` records the count, the method and
each profile's ``date``, ``repeats`` and ``others_cpu_share``.
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, List, Mapping, Sequence, Union

#: top-level keys that must be equal in every merged profile (else they measured different things)
MUST_MATCH = ("format", "device_type", "platform", "model", "seq_len", "statistic", "emulated_slowdown")

_MISSING = object()


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _merge(values: List[Any], path: str, differing: List[str]) -> Any:
    """Median-merge ``values`` (one per profile, :data:`_MISSING` where a profile lacks the key) at ``path``."""
    present = [v for v in values if v is not _MISSING and v is not None]
    if len(present) < len(values):
        if present and any(v is _MISSING or v is None for v in values):
            differing.append(path)
        if not present:
            return None
    first = present[0]
    if all(_is_number(v) for v in present):
        if all(v == first for v in present):
            return first
        return float(statistics.median(present))
    if all(isinstance(v, Mapping) for v in present):
        keys = list(dict.fromkeys(k for v in present for k in v))
        return {k: _merge([v.get(k, _MISSING) for v in present], f"{path}.{k}", differing) for k in keys}
    if all(isinstance(v, (list, tuple)) for v in present):
        if len({len(v) for v in present}) != 1:
            differing.append(path)
            return first
        return [_merge([v[i] for v in present], f"{path}[{i}]", differing) for i in range(len(first))]
    if any(v != first for v in present):
        differing.append(path)
    return first


def sample_key(sample: Mapping[str, Any]) -> tuple:
    """What a sample measured, not what it found: its scalar fields that are not floats (kind, stage, phase, sizes,
    degrees, flags, counts), sorted by name; floats and nested dicts or lists (measured figures) are left out. Two
    profiles' samples with one key measured the same thing (a figure measured once per repeat, e.g.
    ``runtime_overhead``, has one key per repeat: the ``i``-th repeats are merged)."""
    return tuple(sorted((k, v) for k, v in sample.items()
                        if v is None or isinstance(v, (str, int, bool)) and not isinstance(v, float)))


def merge_samples(lists: Sequence[Sequence[Mapping[str, Any]]], differing: List[str]) -> list:
    """The samples of several profiles matched by :func:`sample_key` (the ``i``-th sample of a key with the
    ``i``-th of the same key elsewhere), in the first list's order, each number the median over the profiles that
    have that sample (:func:`_merge`); samples only some profiles have are kept (first seen order after the first
    list's) and listed in ``differing`` as ``samples[key]``."""
    keyed: List[dict] = []
    order: List[tuple] = []
    for samples in lists:
        seen: dict = {}
        d = {}
        for smp in samples:
            k = sample_key(smp)
            seen[k] = seen.get(k, -1) + 1
            d[(k, seen[k])] = smp
            if (k, seen[k]) not in order:
                order.append((k, seen[k]))
        keyed.append(d)
    out = []
    for k in order:
        have = [d.get(k, _MISSING) for d in keyed]
        if any(v is _MISSING for v in have):
            differing.append(f"samples[{dict(k[0]).get('kind', '?')} #{k[1]}]")  # the kind's i-th of this key
        out.append(_merge([v for v in have if v is not _MISSING], f"samples[{k[1]}]", differing))
    return out


def merge_profiles(profiles: Sequence[Union[Mapping[str, Any], str]]) -> dict:
    """One profile whose figures are the medians of ``profiles`` (dicts or JSON paths; see the module docstring).

    Args:
      profiles: at least one profile of :data:`hethub_jax.planner.costs.PROFILE_FORMAT`, all made with the same
        profiler arguments.

    Returns:
      The merged profile dict, with ``merged = {"count", "method", "dates", "repeats", "others_cpu_share",
      "differing"}``.

    Raises:
      ValueError: no profiles; a :data:`MUST_MATCH` key differs.
    """
    profs: List[Mapping[str, Any]] = []
    for p in profiles:
        if isinstance(p, Mapping):
            profs.append(p)
        else:
            with open(p) as f:
                profs.append(json.load(f))
    if not profs:
        raise ValueError("merge_profiles needs at least one profile")
    first = profs[0]
    for k in MUST_MATCH:
        vals = [p.get(k) for p in profs]
        if any(v != vals[0] for v in vals):
            raise ValueError(f"profiles differ in {k!r} ({vals}): they measured different things, not mergeable")
    differing: List[str] = []
    out = dict(first)
    out["samples"] = merge_samples([p.get("samples") or [] for p in profs], differing)
    if any("fits" in p for p in profs):
        out["fits"] = _merge([p.get("fits", _MISSING) for p in profs], "fits", differing)
    shares = [p.get("others_cpu_share") for p in profs]
    out["others_cpu_share"] = (float(statistics.median([s for s in shares if s is not None]))
                               if any(s is not None for s in shares) else None)
    out["merged"] = {"count": len(profs),
                     "method": "median per number over the profiles (hethub_jax.planner.profile_merge)",
                     "dates": [p.get("date") for p in profs], "repeats": [p.get("repeats") for p in profs],
                     "others_cpu_share": shares, "differing": differing}
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Median of several profiles, figure by figure")
    ap.add_argument("--out", required=True, help="merged profile JSON to write")
    ap.add_argument("profiles", nargs="+", help="profile JSONs (same profiler arguments)")
    args = ap.parse_args(argv)
    try:
        merged = merge_profiles(args.profiles)
    except (ValueError, OSError) as e:
        raise SystemExit(f"profile_merge: {e}") from None
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"merged {len(args.profiles)} profiles into {args.out}"
          + (f" ({len(merged['merged']['differing'])} paths differ in presence or length: first profile's)"
             if merged["merged"]["differing"] else ""))
    return merged


if __name__ == "__main__":
    main()
