"""Building frozen config dataclasses from plain dicts (JSON, YAML) with unknown keys rejected."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def from_dict_strict(cls: type[T], d: Mapping[str, Any], what: str) -> T:
    """`cls(**d)` for a dataclass `cls`.

    Raises:
      ValueError: if `d` has keys that are not fields of `cls`, naming them and `what` (e.g.
        "LlamaConfig", "optim"); and whatever `cls` raises for bad values.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {what} key(s) {unknown}; known keys: {sorted(names)}")
    return cls(**dict(d))
