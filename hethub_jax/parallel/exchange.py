"""Row routing between the processes of two pipeline stages (issue 15 part 2). Pure Python, no JAX.

A stage's mesh is ``(dp, tp)`` over island-global device indices (``Plan.stage_devices``); process
``p`` of an island holds devices ``p * devices_per_process .. (p + 1) * devices_per_process - 1``.
Activations ``[microbatch, S, D]`` are split over ``dp`` on the batch dimension, so DP row ``i`` holds
samples ``[i * mb / dp, (i + 1) * mb / dp)`` of each microbatch. When every DP row lies inside one
process (TP inside a process) and each process's rows are consecutive, each process of the stage
holds one contiguous block of samples (``process_rows``). Between two stages, every process sends
the part of its block that each process of the next stage holds (``routes``): the exchange of one
stage boundary runs between matching processes in parallel instead of through one rank, and stages
of different DP degree re-slice.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

Rows = Dict[int, Tuple[int, int]]  # process index in its island -> [start, stop) of a microbatch


def row_processes(devices: Sequence[int], dp: int, tp: int, devices_per_process: int) -> List[int]:
    """Island process index of each of a stage's ``dp`` DP rows.

    Args:
      devices: the stage's ``dp * tp`` island-global device indices, row-major over ``(dp, tp)``.
      dp, tp: the stage's mesh shape.
      devices_per_process: devices of each process of the island.

    Raises:
      ValueError: if a DP row's ``tp`` devices belong to more than one process (TP must stay inside a
        process), or a process's rows are not consecutive (its samples would not be one block).
    """
    if len(devices) != dp * tp:
        raise ValueError(f"a stage of dp*tp = {dp}*{tp} needs {dp * tp} devices, got {len(devices)}")
    procs = []
    for i in range(dp):
        row = devices[i * tp:(i + 1) * tp]
        owners = sorted({d // devices_per_process for d in row})
        if len(owners) != 1:
            raise ValueError(f"DP row {i} (devices {list(row)}) spans processes {owners} of "
                             f"{devices_per_process} devices each: TP must fit inside one process "
                             f"(tp divides devices_per_process and rows start on a process boundary)")
        procs.append(owners[0])
    seen: list[int] = []
    for p in procs:
        if seen and p != seen[-1] and p in seen:
            raise ValueError(f"the DP rows of a stage on processes {procs}: each process's rows must be "
                             f"consecutive (order the stage's devices by process)")
        if not seen or p != seen[-1]:
            seen.append(p)
    return procs


def process_rows(microbatch_size: int, row_procs: Sequence[int]) -> Rows:
    """Samples ``[start, stop)`` of a microbatch held by each process of a stage.

    Args:
      microbatch_size: samples per microbatch (divisible by the DP degree ``len(row_procs)``).
      row_procs: process index of each DP row (``row_processes``).

    Raises:
      ValueError: if the DP degree does not divide the microbatch size.
    """
    dp = len(row_procs)
    if dp < 1 or microbatch_size % dp:
        raise ValueError(f"microbatch_size {microbatch_size} must be divisible by the DP degree {dp}")
    k = microbatch_size // dp
    out: Rows = {}
    for i, p in enumerate(row_procs):
        lo, hi = out.get(p, (i * k, i * k))
        out[p] = (lo, hi + k)
    return out


def routes(src: Rows, dst: Rows) -> List[Tuple[int, int, int, int]]:
    """``(source process, destination process, start, stop)`` for every non-empty overlap of a
    source process's samples with a destination process's, in (source, destination) order. Each pair
    of processes appears at most once (both hold one block)."""
    out = []
    for p, (a0, a1) in sorted(src.items()):
        for q, (b0, b1) in sorted(dst.items()):
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                out.append((p, q, lo, hi))
    return out
