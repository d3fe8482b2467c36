"""Fast exact pipeline makespan and its lower bound, for the planner's inner loop (pure Python).

:func:`makespan` gives the same number as :func:`hethub_jax.planner.simulator.simulate` (``makespan_s``)
for a schedule whose F and B times are constant per stage and whose message times are constant per
(stage boundary, direction), with far less work: the schedule's action lists are reduced once per
``(schedule, S, M)`` to their compute actions in a valid execution order (cached), then one pass of
max-plus arithmetic over those 2*S*M actions computes every end time. The arithmetic is the simulator's,
operation for operation (SEND takes 0 s; a RECV ends at ``max(stage clock, send end + message time)``;
the compute starts there), so the floats are identical; ``tests/test_planner.py`` checks this.

:func:`makespan_lower_bound` is the bound the search prunes with. For any schedule in which every stage
runs M forwards and M backwards, the last action of every stage is a backward, and message times are
>= 0 (GPipe and 1F1B): stage ``b`` cannot start its first forward before microbatch 0 has passed the
forwards of stages ``0..b-1`` (>= sum of their F), it is busy ``M * (F_b + B_b)`` after that, and after its
last backward the backwards of stages ``b-1..0`` for that microbatch still have to run (>= sum of their B).
Hence ``makespan >= M * t_b + sum_{s<b} t_s`` for every ``b``, with ``t_s = F_s + B_s``.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence, Tuple

from hethub_jax.parallel.schedule import execution_order, get_schedule
from hethub_jax.planner.simulator import _flatten_codes, _slot_codes, sweep_order

__all__ = ["compute_order", "makespan", "makespan_lower_bound"]


@lru_cache(maxsize=256)
def compute_order(schedule: str, num_stages: int, num_microbatches: int) -> Tuple[Tuple[int, bool, int], ...]:
    """The compute actions of ``schedule`` as ``(stage, is_backward, microbatch)`` in the deterministic
    execution order of :func:`hethub_jax.parallel.schedule.execution_order` (a valid topological order:
    every action comes after the actions it waits for). Cached per argument triple; GPipe and 1F1B are
    read off the simulator's integer form (``simulator._slot_codes``, ``sweep_order``) without building
    Action objects.

    Raises:
      ValueError: for an unknown schedule or sizes < 1.
    """
    make = get_schedule(schedule)
    stages = _slot_codes(schedule, num_stages, num_microbatches) if num_stages > 0 and num_microbatches > 0 else None
    if stages is not None:  # gpipe / 1f1b: the same order from the integer form, without Action objects
        code, rmsg, smsg, _, nmsg, off = _flatten_codes([(0, s, c, m, p) for s, (c, m, p) in enumerate(stages)])
        order = sweep_order(off, rmsg, smsg, nmsg)
        if order is not None:
            mb = [x for _, m, _ in stages for x in m]
            stage_of = [s for s, (c, _, _) in enumerate(stages) for _ in c]
            return tuple((stage_of[g], code[g] == 1, mb[g]) for g in order if code[g] < 2)
    acts = make(num_stages, num_microbatches)
    out = []
    for s, i in execution_order(acts):
        a = acts[s][i]
        if a.is_compute:
            out.append((s, a.kind.value == "B", a.microbatch))
    return tuple(out)


def makespan(schedule: str, num_microbatches: int, fwd_s: Sequence[float], bwd_s: Sequence[float],
             act_comm_s: Sequence[float], grad_comm_s: Sequence[float]) -> float:
    """Makespan (seconds) of one step of ``schedule`` over ``len(fwd_s)`` stages and ``num_microbatches``
    microbatches, equal to ``simulate(...).makespan_s`` with the same per-stage times.

    Args:
      fwd_s, bwd_s: per stage, seconds of one microbatch's F and B (length S).
      act_comm_s: per boundary ``s`` (S - 1 entries), seconds from the end of stage ``s``'s SEND_ACT until
        stage ``s + 1`` can receive it.
      grad_comm_s: per boundary ``s``, seconds of the SEND_GRAD from stage ``s + 1`` to stage ``s``.
    """
    S, M = len(fwd_s), num_microbatches
    clock = [0.0] * S
    fend = [0.0] * (S * M)
    bend = [0.0] * (S * M)
    last = S - 1
    for s, is_b, m in compute_order(schedule, S, M):
        c = clock[s]
        if is_b:
            if s < last:
                d = bend[(s + 1) * M + m] + grad_comm_s[s]
                if d > c:
                    c = d
            c = c + bwd_s[s]
            bend[s * M + m] = c
        else:
            if s > 0:
                d = fend[(s - 1) * M + m] + act_comm_s[s - 1]
                if d > c:
                    c = d
            c = c + fwd_s[s]
            fend[s * M + m] = c
        clock[s] = c
    return max(clock)


def makespan_lower_bound(num_microbatches: int, stage_s: Sequence[float]) -> float:
    """``max_b (M * t_b + sum_{s<b} t_s)`` for per-stage ``t_s = F_s + B_s`` seconds (derivation in the
    module docstring); a lower bound of :func:`makespan` for GPipe and 1F1B with message times >= 0."""
    best, prefix = 0.0, 0.0
    for t in stage_s:
        v = num_microbatches * t + prefix
        if v > best:
            best = v
        prefix += t
    return best
