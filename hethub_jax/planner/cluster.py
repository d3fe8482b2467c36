"""Cluster specification for the planner: node groups of one device type and the links between them.

A cluster spec (YAML, format in ``docs/cluster_spec.md``; examples in ``configs/clusters/``) is a pydantic
v2 model, frozen, with unknown keys rejected. Each node group becomes one island of a plan (one JAX runtime
per device type, DESIGN.md section 2): ``num_processes`` = the group's nodes (one process per node),
``devices_per_process`` = its devices per node.

Pure Python: imports no JAX. Device defaults (bandwidths, devices per node, platform) come from the
predictor's device catalog (``hethub_jax.planner.catalog``), imported when a group asks for them.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["NodeGroup", "GroupLink", "ClusterSpec", "load_cluster", "cluster_from_dict", "islands_of",
           "PLATFORM_OF_VENDOR"]

#: JAX platform of each catalog vendor (``DeviceSpec.vendor``, lower case); a group may override it with
#: ``platform``. Vendors with no JAX platform here (Huawei, Intel) get a label (``npu``, ``gaudi``) that a
#: plugin-provided platform name must replace.
PLATFORM_OF_VENDOR = {"nvidia": "cuda", "amd": "rocm", "any": "cpu", "cpu": "cpu", "huawei": "npu",
                      "intel": "gaudi", "google": "tpu"}

#: Cross-group link used when the spec names none for a pair: 100 Gbit/s Ethernet/InfiniBand-class host
#: path (12.5e9 bytes/s) with 20 microseconds latency. A stated assumption, not a measurement.
DEFAULT_LINK_BANDWIDTH = 12.5e9
DEFAULT_LINK_LATENCY_S = 20e-6


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class NodeGroup(_Strict):
    """A group of identical nodes: one device type, one island of the plan.

    Attributes:
      name: unique group name; becomes the island name.
      device: a device catalog name (``hethub_jax.planner.catalog.CATALOG``), e.g. ``"h100"``. Exactly
        one of ``device`` / ``profile`` is given.
      profile: path of a measured profile file (``python -m hethub_jax.profile``); relative paths are
        taken relative to the cluster file.
      nodes: node count (= processes of the island), >= 1.
      devices_per_node: accelerators per node (= devices per process); default: the catalog's.
      intra_node_bandwidth: bytes/s per device inside a node; default: the catalog's.
      network_bandwidth: bytes/s per device between nodes of the group; default: the catalog's.
      platform: JAX platform of the island; default from the catalog vendor (nvidia -> cuda, amd -> rocm).
      slowdown: emulated slowdown factor >= 1 (DESIGN.md section 9), only for platform ``cpu``.
      efficiency: fraction of the catalog's datasheet peaks assumed reachable, in (0, 1]; default None:
        the planner's (``SearchOptions.efficiency``, 0.4). Catalog groups only (a profile is measured).
    """

    name: str = Field(min_length=1)
    device: Optional[str] = None
    profile: Optional[str] = None
    nodes: int = Field(ge=1)
    devices_per_node: Optional[int] = Field(default=None, ge=1)
    intra_node_bandwidth: Optional[float] = Field(default=None, gt=0)
    network_bandwidth: Optional[float] = Field(default=None, gt=0)
    platform: Optional[str] = None
    slowdown: float = Field(default=1.0, ge=1.0, allow_inf_nan=False)
    efficiency: Optional[float] = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_source(self) -> "NodeGroup":
        if (self.device is None) == (self.profile is None):
            raise ValueError(f"node group {self.name!r}: give exactly one of 'device' (a catalog name) or "
                             f"'profile' (a profile file path)")
        if self.efficiency is not None and self.profile is not None:
            raise ValueError(f"node group {self.name!r}: 'efficiency' scales catalog datasheet peaks; a group "
                             f"with a measured 'profile' has none to scale")
        if self.device is not None:
            from hethub_jax.planner.catalog import get_device
            try:  # checked at load, so the error names the file and the group as key typos do
                get_device(self.device)
            except ValueError as e:
                raise ValueError(f"node group {self.name!r}: {e}") from None
        return self

    @property
    def num_devices(self) -> int:
        """``nodes * devices_per_node`` (after defaults are filled, see :meth:`ClusterSpec.resolved`)."""
        return self.nodes * (self.devices_per_node or 0)


class GroupLink(_Strict):
    """The link between two node groups (the cross-island host bridge).

    Attributes:
      between: the two group names (order does not matter).
      bandwidth: bytes/s of one process pair's transfer.
      latency_s: per-message latency, seconds (alpha of the alpha-beta model).
    """

    between: Tuple[str, str]
    bandwidth: float = Field(gt=0, allow_inf_nan=False)
    latency_s: float = Field(default=DEFAULT_LINK_LATENCY_S, ge=0, allow_inf_nan=False)


class ClusterSpec(_Strict):
    """A heterogeneous cluster: node groups and the links between groups.

    Attributes:
      name: short name shown in tables.
      description: free text.
      groups: the node groups (at least one), unique names.
      links: links between group pairs; a pair not listed uses ``default_link``.
      default_link: bandwidth (bytes/s) and latency (s) of unlisted pairs; default 12.5e9 bytes/s, 20 us
        (stated assumption: a 100 Gbit/s host path).
    """

    name: str = "cluster"
    description: str = ""
    groups: Tuple[NodeGroup, ...] = Field(min_length=1)
    links: Tuple[GroupLink, ...] = ()
    default_link: Dict[str, float] = Field(default_factory=lambda: {
        "bandwidth": DEFAULT_LINK_BANDWIDTH, "latency_s": DEFAULT_LINK_LATENCY_S})

    @model_validator(mode="after")
    def _check(self) -> "ClusterSpec":
        names = [g.name for g in self.groups]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"groups: names must be unique, {dup} repeated")
        for i, link in enumerate(self.links):
            for n in link.between:
                if n not in names:
                    raise ValueError(f"links[{i}].between names unknown group {n!r}; groups: {names}")
            if link.between[0] == link.between[1]:
                raise ValueError(f"links[{i}].between names group {link.between[0]!r} twice")
        extra = set(self.default_link) - {"bandwidth", "latency_s"}
        if extra or not self.default_link.get("bandwidth", 0) > 0 or self.default_link.get("latency_s", 0) < 0:
            raise ValueError(f"default_link needs bandwidth > 0 (bytes/s) and latency_s >= 0 (s), and no other "
                             f"keys; got {dict(self.default_link)}")
        return self

    # ---- derived ---------------------------------------------------------------------------------
    def group(self, name: str) -> NodeGroup:
        """The group called ``name``. Raises ValueError naming the known groups."""
        for g in self.groups:
            if g.name == name:
                return g
        raise ValueError(f"unknown node group {name!r}; groups: {[g.name for g in self.groups]}")

    def link(self, a: str, b: str) -> Tuple[float, float]:
        """``(bandwidth bytes/s, latency s)`` between groups ``a`` and ``b``."""
        for link in self.links:
            if set(link.between) == {a, b}:
                return link.bandwidth, link.latency_s
        return float(self.default_link["bandwidth"]), float(self.default_link.get("latency_s", DEFAULT_LINK_LATENCY_S))

    @property
    def num_devices(self) -> int:
        return sum(g.num_devices for g in self.resolved().groups)

    def resolved(self) -> "ClusterSpec":
        """A copy with every catalog default filled in (``devices_per_node``, bandwidths, platform).

        Raises:
          ValueError: for an unknown catalog name (naming the known ones) or slowdown on a non-cpu group.
        """
        if all(g.devices_per_node and g.intra_node_bandwidth and g.network_bandwidth and g.platform
               for g in self.groups):
            return self
        return self.model_copy(update={"groups": tuple(_resolve_group(g) for g in self.groups)})

    def with_group(self, name: str, **changes: Any) -> "ClusterSpec":
        """A copy with group ``name`` changed (e.g. ``nodes=24``); validated. For what-if questions."""
        self.group(name)
        groups = [g.model_dump(exclude_none=True) | changes if g.name == name else g.model_dump(exclude_none=True)
                  for g in self.groups]
        return cluster_from_dict({**self.model_dump(exclude_none=True), "groups": groups})

    def add_group(self, **fields: Any) -> "ClusterSpec":
        """A copy with one more node group (fields as in :class:`NodeGroup`); validated."""
        d = self.model_dump(exclude_none=True)
        return cluster_from_dict({**d, "groups": list(d["groups"]) + [fields]})


def _resolve_group(g: NodeGroup) -> NodeGroup:
    upd: Dict[str, Any] = {}
    if g.device is not None:
        from hethub_jax.planner.catalog import get_device
        spec = get_device(g.device)
        upd = {"devices_per_node": g.devices_per_node or spec.devices_per_node,
               "intra_node_bandwidth": g.intra_node_bandwidth or spec.intra_node_bandwidth,
               "network_bandwidth": g.network_bandwidth or spec.network_bandwidth,
               "platform": g.platform or PLATFORM_OF_VENDOR.get(str(spec.vendor).lower(), str(spec.vendor).lower())}
    else:
        missing = [k for k in ("devices_per_node", "intra_node_bandwidth", "network_bandwidth", "platform")
                   if getattr(g, k) is None]
        if missing:
            raise ValueError(f"node group {g.name!r} gives a profile, not a catalog device, so it must give "
                             f"{missing} itself")
    out = g.model_copy(update=upd)
    if out.slowdown != 1.0 and out.platform != "cpu":
        raise ValueError(f"node group {g.name!r}: slowdown (speed emulation, DESIGN.md section 9) applies only to "
                         f"platform 'cpu', the group has platform {out.platform!r}")
    return out


def _loc_text(loc: Tuple[Any, ...], data: Any) -> str:
    """``groups.1 (slow).nodes``: the key path, a group's index followed by its ``name`` in ``data`` (the
    spec as given) when it has one; ``(top level)`` for an empty path."""
    parts, node = [], data
    for key in loc:
        node = (node[key] if isinstance(node, (list, tuple)) and isinstance(key, int) and 0 <= key < len(node)
                else node.get(key) if isinstance(node, Mapping) else None)
        name = node.get("name") if isinstance(key, int) and isinstance(node, Mapping) else None
        parts.append(f"{key} ({name})" if isinstance(name, str) and name else str(key))
    return ".".join(parts) or "(top level)"


def _format_errors(e: ValidationError, where: str, data: Any = None) -> str:
    """One line per error, ``key.path: what``, a group named beside its index (``groups.1 (slow).nodes``;
    pydantic's ``Value error, `` prefix of a cross-field check left out). An unknown key is reported with the closest known key
    (``groups.0.devise: unknown key (did you mean 'device'?)``), and the errors that follow from it
    are left out: a required key missing from the same mapping (most likely the misspelled one) and
    a list's "at least 1 item" when the list has items (pydantic counts the items that validated)."""
    errs = e.errors()
    unknown_in = {tuple(err["loc"][:-1]) for err in errs if err["type"] == "extra_forbidden"}
    lines = []
    for err in errs:
        loc_t = tuple(err["loc"])
        loc = _loc_text(loc_t, data)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing" and loc_t[:-1] in unknown_in:
            continue
        if err["type"] == "too_short" and isinstance(err.get("input"), (list, tuple)):
            need = err.get("ctx", {}).get("min_length", 1)
            if len(err["input"]) >= need:
                continue
            msg = f"needs at least {need} item(s), got {len(err['input'])}"
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + _did_you_mean(loc_t)
        lines.append(f"  {loc}: {msg}")
    return f"invalid cluster spec {where}:\n" + "\n".join(lines)


def _did_you_mean(loc: Tuple[Any, ...]) -> str:
    """`` (did you mean 'nodes'?)`` for an unknown key at ``loc`` close to a key of its mapping
    (``difflib``), ``"; known keys: [...]"`` otherwise."""
    import difflib
    model: Any = ClusterSpec
    for key in loc[:-1]:
        if isinstance(key, int):
            continue
        model = {"groups": NodeGroup, "links": GroupLink}.get(key) if model is ClusterSpec else None
        if model is None:
            return ""
    known = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f"; known keys: {known}"


def cluster_from_dict(d: Mapping[str, Any], where: str = "") -> ClusterSpec:
    """Build and check a :class:`ClusterSpec` from a plain dict (YAML/JSON object).

    Raises:
      ValueError: for an unknown or missing key or a bad value, naming the key path
        (e.g. ``groups.1.nodes``).
    """
    try:
        return ClusterSpec.model_validate(dict(d))
    except ValidationError as e:
        raise ValueError(_format_errors(e, where or "(dict)", d)) from None


def load_cluster(source: Union[str, os.PathLike, Mapping[str, Any], ClusterSpec]) -> ClusterSpec:
    """Load a cluster spec from a YAML file path, a dict, or pass a :class:`ClusterSpec` through.

    Relative ``profile`` paths are made relative to the YAML file's folder.

    Raises:
      ValueError: as :func:`cluster_from_dict`, or for invalid YAML.
      FileNotFoundError: ``cluster spec file not found: PATH`` (an ``OSError``).
      OSError: if the file cannot be read.
    """
    if isinstance(source, ClusterSpec):
        return source
    if isinstance(source, Mapping):
        return cluster_from_dict(source)
    import yaml
    path = os.fspath(source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"cluster spec file not found: {path} (a YAML file, docs/cluster_spec.md; "
                                f"examples in configs/clusters/)")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"invalid YAML in cluster spec {path}: {e}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"cluster spec {path} must be a YAML mapping, got {type(data).__name__}")
    base = os.path.dirname(os.path.abspath(path))
    groups = data.get("groups")
    if isinstance(groups, list):
        data = dict(data, groups=[dict(g, profile=os.path.join(base, g["profile"]))
                                  if isinstance(g, Mapping) and isinstance(g.get("profile"), str)
                                  and not os.path.isabs(g["profile"]) else g for g in groups])
    return cluster_from_dict(data, path)


def islands_of(cluster: ClusterSpec, names: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """The plan's ``islands`` entries (JSON objects) of the named groups (all by default), in the order given."""
    c = cluster.resolved()
    out = []
    for n in names or [g.name for g in c.groups]:
        g = c.group(n)
        out.append({"name": g.name, "platform": g.platform, "num_processes": g.nodes,
                    "devices_per_process": g.devices_per_node, "slowdown": float(g.slowdown)})
    return out

