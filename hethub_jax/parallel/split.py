"""One island per pipeline stage: split the islands of several processes of a plan (pure Python).

An island of several processes is one ``jax.distributed`` runtime whose processes run every stage of
the island, in the same order on all of them (``PipelineRuntime``); with several stages they could
order the stages' collectives differently, so the runtime runs one stage on such an island
(``rules.check_runtime_support``). When the stages of such an island hold disjoint processes (the
planner's plans for a multi-node group: each stage takes whole nodes), the island is equivalent to one
island per stage, each its own ``jax.distributed`` runtime with the same device type: every process
then runs exactly one stage and the stages of the group run concurrently, each process only waiting
for its own stage's messages. This module computes that plan (docs/multiprocess_islands.md,
"Several stages on a multi-node group").

``python -m hethub_jax.parallel.split PLAN.json [OUT.json]`` writes (or prints) the split plan.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hethub_jax.parallel.plan import Plan

__all__ = ["stage_processes", "island_components", "split_islands"]

Key = Tuple[int, int]


def stage_processes(plan: Plan, r: int, s: int) -> List[int]:
    """Island-local indices (0 .. ``num_processes - 1``) of the processes holding a device of stage
    ``(r, s)``, ascending. Raises ValueError as :meth:`Plan.stage_devices`."""
    per = plan.island(plan.stage(r, s).island).devices_per_process
    return sorted({d // per for d in plan.stage_devices(r, s)})


def island_components(plan: Plan, name: str) -> List[Tuple[List[Key], List[int]]]:
    """The stages of island ``name`` grouped by shared processes: two stages are in one component
    when they hold devices of one process (transitively). Per component ``(stages in plan order,
    processes ascending)``, components ordered by their first process; processes that hold no stage
    belong to none.

    Raises:
      ValueError: unknown island, or stage devices the island lacks (:meth:`Plan.stage_devices`).
    """
    comps: List[Tuple[List[Key], set]] = []
    for key in plan.island_stages(name):
        procs = set(stage_processes(plan, *key))
        hit = [c for c in comps if c[1] & procs]
        merged = ([k for c in hit for k in c[0]] + [key], procs.union(*(c[1] for c in hit)))
        comps = [c for c in comps if not c[1] & procs] + [merged]
    out = [(sorted(ks), sorted(ps)) for ks, ps in comps]
    return sorted(out, key=lambda c: c[1][0])


def split_islands(plan: Plan) -> Tuple[Plan, Dict[str, str]]:
    """The plan with each island of several processes replaced by one island per component of
    :func:`island_components` (one per stage when the stages hold disjoint processes), and the map
    new island name -> original island name.

    A component's island keeps the platform, ``devices_per_process`` and ``slowdown``, takes the
    component's processes (their order kept; processes holding no stage are dropped, so the world
    size may shrink) and is named ``"<island>.<i>"`` (``i`` counts the island's components from 0)
    unless it is the island's only component. Stage device indices are renumbered to the new island
    (process ``p``'s device ``j`` becomes ``new_index(p) * devices_per_process + j``); ``devices`` is
    written only where the default assignment (:meth:`Plan.stage_devices`) would differ. Layers, DP,
    TP, batch shares, schedule and recompute are unchanged; islands of one process are unchanged.
    A component of several stages on several processes stays one island (the runtime refuses it:
    ``rules.check_runtime_support``).

    Raises:
      ValueError: when a new name is taken by another island, or as :meth:`Plan.validate` for a plan
        whose stage devices do not exist.
    """
    d = plan.to_dict()
    names = {i.name for i in plan.islands}
    islands: List[Dict[str, Any]] = []
    origin: Dict[str, str] = {}
    for isl, spec in zip(plan.islands, d["islands"]):
        comps = island_components(plan, isl.name)
        if isl.num_processes == 1 or (len(comps) == 1 and len(comps[0][1]) == isl.num_processes):
            islands.append(spec)
            origin[isl.name] = isl.name
            continue
        for i, (keys, procs) in enumerate(comps):
            new = isl.name if len(comps) == 1 else f"{isl.name}.{i}"
            if new != isl.name and new in names:
                raise ValueError(f"cannot split island {isl.name!r}: the name {new!r} of its part {i} is taken "
                                 f"by another island")
            islands.append({**spec, "name": new, "num_processes": len(procs)})
            origin[new] = isl.name
            _renumber(plan, d, keys, procs, new)
    out = dict(d, islands=islands)
    if len(islands) != len(plan.islands) or any(i["num_processes"] != o.num_processes
                                                for i, o in zip(islands, plan.islands)):
        parts = {o: [n for n in origin if origin[n] == o] for o in dict.fromkeys(origin.values())}
        note = "; ".join(f"{o} -> {', '.join(ns)}" for o, ns in parts.items() if ns != [o])
        out["description"] = (d.get("description", "") + f" [islands split per stage: {note}]").strip()
    return Plan.from_dict(out), origin


def _renumber(plan: Plan, d: Dict[str, Any], keys: Sequence[Key], procs: Sequence[int], new: str) -> None:
    """Point stages ``keys`` of the plan dict ``d`` at island ``new`` (the processes ``procs`` of their
    island, in this order) with renumbered devices; explicit only where the default would differ."""
    per = plan.island(plan.stage(*keys[0]).island).devices_per_process
    pos = {p: i for i, p in enumerate(procs)}
    nxt, explicit = 0, []
    for r, s in keys:
        devs = [pos[x // per] * per + x % per for x in plan.stage_devices(r, s)]
        st = d["replicas"][r]["stages"][s]
        st["island"] = new
        st["devices"] = devs
        explicit.append(devs != list(range(nxt, nxt + len(devs))))
        nxt += len(devs)
    if not any(explicit):  # the default assignment gives the same devices
        for r, s in keys:
            d["replicas"][r]["stages"][s].pop("devices")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (1, 2) or args[0].startswith("-"):
        print("usage: python -m hethub_jax.parallel.split PLAN.json [OUT.json]", file=sys.stderr)
        return 2
    try:
        plan, _ = split_islands(Plan.from_json(args[0]))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = plan.to_json(args[1] if len(args) == 2 else None)
    if len(args) == 1:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
