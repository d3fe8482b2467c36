"""Pipeline schedules as plain data (pure Python, no JAX).

A schedule maps (number of pipeline stages S, number of microbatches M) to one ordered list of
:class:`Action` per pipeline stage: ``actions_per_stage[s]`` is what stage ``s`` executes, in order.
The runtime executes these lists, the predictor's simulator (``hethub_jax.planner.simulator``) times
the very same lists, and the tests below check them without any device (DESIGN.md section 6).

Layout of one stage's list (both schedules)::

    [RECV_ACT(mb, s-1)]  F(mb)  [SEND_ACT(mb, s+1)]      # a forward slot
    [RECV_GRAD(mb, s+1)] B(mb)  [SEND_GRAD(mb, s-1)]     # a backward slot

the bracketed actions are absent on the first stage (no RECV_ACT / SEND_GRAD) and on the last stage
(no SEND_ACT / RECV_GRAD); with S = 1 a list holds only F and B. A RECV directly precedes the compute
that consumes it and a SEND directly follows the compute that produced it. Messages are matched by
(kind, source stage, destination stage, microbatch), never by arrival order.

Execution model assumed by :func:`execution_order` and the simulator: a SEND never blocks (it is
buffered / non-blocking); a RECV blocks until the matching SEND has run.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "ActionKind", "Action", "ScheduleDeadlock", "gpipe", "one_f_one_b", "SCHEDULES", "get_schedule",
    "validate_schedule", "max_in_flight", "in_flight_bound", "execution_order", "message_key",
]


class ActionKind(str, enum.Enum):
    """Kinds of pipeline actions. ``str`` subclass: ``ActionKind.F == "F"``."""

    F = "F"                  #: forward of one microbatch through the stage
    B = "B"                  #: backward of one microbatch through the stage
    SEND_ACT = "SEND_ACT"    #: send the stage output (activation) to the next stage (peer = s + 1)
    RECV_ACT = "RECV_ACT"    #: receive the stage input (activation) from the previous stage (peer = s - 1)
    SEND_GRAD = "SEND_GRAD"  #: send the gradient w.r.t. the stage input to the previous stage (peer = s - 1)
    RECV_GRAD = "RECV_GRAD"  #: receive the gradient w.r.t. the stage output from the next stage (peer = s + 1)

    def __str__(self) -> str:  # "F", not "ActionKind.F"
        return self.value


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B})
SEND_KINDS = frozenset({ActionKind.SEND_ACT, ActionKind.SEND_GRAD})
RECV_KINDS = frozenset({ActionKind.RECV_ACT, ActionKind.RECV_GRAD})
#: the receive kind that matches each send kind
MATCHING_RECV = {ActionKind.SEND_ACT: ActionKind.RECV_ACT, ActionKind.SEND_GRAD: ActionKind.RECV_GRAD}


@dataclass(frozen=True)
class Action:
    """One step of one pipeline stage.

    Attributes:
      kind: an :class:`ActionKind` (a plain string such as ``"F"`` is converted).
      microbatch: microbatch index, ``0 <= microbatch < M``.
      peer: for SEND_*/RECV_* the index of the peer pipeline stage; ``None`` for F and B.

    ``str(action)`` is ``"F3"`` / ``"B3"`` for compute, ``"SEND_ACT3->1"`` for a send of microbatch 3
    to stage 1 and ``"RECV_GRAD3<-2"`` for a receive of microbatch 3 from stage 2.
    """

    kind: ActionKind
    microbatch: int
    peer: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.microbatch < 0:
            raise ValueError(f"microbatch must be >= 0, got {self.microbatch}")
        if self.is_compute and self.peer is not None:
            raise ValueError(f"{self.kind} actions take no peer, got peer={self.peer}")
        if not self.is_compute and self.peer is None:
            raise ValueError(f"{self.kind} actions need a peer stage")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECV_KINDS

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind}{self.microbatch}"
        arrow = "->" if self.is_send else "<-"
        return f"{self.kind}{self.microbatch}{arrow}{self.peer}"


class ScheduleDeadlock(ValueError):
    """Raised when no stage can make progress: every unfinished stage waits on a RECV whose SEND has
    not run (and cannot run). The message names each stuck stage and action."""


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def _forward_slot(s: int, num_stages: int, mb: int) -> List[Action]:
    out = []
    if s > 0:
        out.append(Action(ActionKind.RECV_ACT, mb, s - 1))
    out.append(Action(ActionKind.F, mb))
    if s < num_stages - 1:
        out.append(Action(ActionKind.SEND_ACT, mb, s + 1))
    return out


def _backward_slot(s: int, num_stages: int, mb: int) -> List[Action]:
    out = []
    if s < num_stages - 1:
        out.append(Action(ActionKind.RECV_GRAD, mb, s + 1))
    out.append(Action(ActionKind.B, mb))
    if s > 0:
        out.append(Action(ActionKind.SEND_GRAD, mb, s - 1))
    return out


def gpipe(num_stages: int, num_microbatches: int) -> List[List[Action]]:
    """GPipe (all forwards, then all backwards), Huang et al. 2019, "GPipe: Efficient training of giant
    neural networks using pipeline parallelism", sections 2.2-2.3 (bubble overhead (S - 1) / (M + S - 1)).

    Every stage runs the forward slots of microbatches 0..M-1, then the backward slots of microbatches
    0..M-1 (same order; with uniform stage times the makespan is (M + S - 1) * (t_f + t_b) either way).
    Up to M microbatches are in flight (activations held) on every stage.

    Returns:
      ``actions_per_stage``: a list of S lists of :class:`Action` (layout in the module docstring).
    Raises:
      ValueError: if ``num_stages < 1`` or ``num_microbatches < 1``.
    """
    _check_sizes(num_stages, num_microbatches)
    out = []
    for s in range(num_stages):
        acts: List[Action] = []
        for mb in range(num_microbatches):
            acts += _forward_slot(s, num_stages, mb)
        for mb in range(num_microbatches):
            acts += _backward_slot(s, num_stages, mb)
        out.append(acts)
    return out


def one_f_one_b(num_stages: int, num_microbatches: int) -> List[List[Action]]:
    """1F1B with a flush at the end of the step (PipeDream-Flush), as in Narayanan et al. 2021,
    "Efficient large-scale language model training on GPU clusters using Megatron-LM", section 2.2.1.

    Stage ``s`` (0-based, of S) runs ``w = min(S - s - 1, M)`` warm-up forwards (Megatron-LM's
    ``num_warmup_microbatches``), then ``M - w`` steady-state pairs "forward of mb w+i, backward of mb i",
    then the ``w`` cool-down backwards. Microbatches are processed in order 0..M-1 in both directions.
    At most ``min(S - s, M)`` microbatches are in flight on stage ``s`` (see :func:`in_flight_bound`),
    against M for GPipe; the bubble is the same, (S - 1) / (M + S - 1) of the step for uniform stages.

    Returns:
      ``actions_per_stage``: a list of S lists of :class:`Action` (layout in the module docstring).
    Raises:
      ValueError: if ``num_stages < 1`` or ``num_microbatches < 1``.
    """
    _check_sizes(num_stages, num_microbatches)
    out = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        steady = num_microbatches - warmup
        acts: List[Action] = []
        for mb in range(warmup):
            acts += _forward_slot(s, num_stages, mb)
        for i in range(steady):
            acts += _forward_slot(s, num_stages, warmup + i)
            acts += _backward_slot(s, num_stages, i)
        for mb in range(steady, num_microbatches):
            acts += _backward_slot(s, num_stages, mb)
        out.append(acts)
    return out


#: schedule name (as written in a plan) -> generator ``(num_stages, num_microbatches) -> actions_per_stage``
SCHEDULES: Dict[str, Callable[[int, int], List[List[Action]]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def get_schedule(name: str) -> Callable[[int, int], List[List[Action]]]:
    """The schedule generator for a plan's ``schedule`` name (``"gpipe"`` or ``"1f1b"``).

    Raises:
      ValueError: for an unknown name (the message lists the known ones).
    """
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {sorted(SCHEDULES)}") from None


def in_flight_bound(name: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Most microbatches whose forward ran and whose backward has not, on ``stage``, that schedule
    ``name`` promises: GPipe M; 1F1B ``min(num_stages - stage, M)`` (Narayanan et al. 2021, section
    2.2.1). This is the number of stage inputs/residuals held at once, used by the memory model.

    Raises:
      ValueError: for an unknown schedule name or a stage out of range.
    """
    get_schedule(name)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
    if name == "gpipe":
        return num_microbatches
    return min(num_stages - stage, num_microbatches)


def max_in_flight(actions: Sequence[Action]) -> int:
    """Peak number of microbatches in flight on one stage's list: forwards done whose backward has
    not run yet, maximised over the positions of the list."""
    live, peak = set(), 0
    for a in actions:
        if a.kind == ActionKind.F:
            live.add(a.microbatch)
            peak = max(peak, len(live))
        elif a.kind == ActionKind.B:
            live.discard(a.microbatch)
    return peak


def message_key(stage: int, a: Action) -> Tuple[str, int, int, int]:
    """(recv kind, src stage, dst stage, microbatch): the same key for a SEND and its matching RECV."""
    if a.is_send:
        return (MATCHING_RECV[a.kind].value, stage, a.peer, a.microbatch)
    return (a.kind.value, a.peer, stage, a.microbatch)


def validate_schedule(actions_per_stage: Sequence[Sequence[Action]]) -> None:
    """Check a schedule's structure and that it can run to completion.

    Checks, with M = 1 + the largest microbatch index used anywhere:
      * every stage runs exactly one F and one B of every microbatch 0..M-1, F before B;
      * peers are adjacent: SEND_ACT/RECV_GRAD talk to stage s+1, RECV_ACT/SEND_GRAD to stage s-1,
        and the peer exists;
      * stage s > 0 receives each microbatch's activation before its F and sends its input gradient
        after its B; stage s < S-1 sends each activation after its F and receives the output gradient
        before its B; no other sends or receives;
      * every SEND has exactly one matching RECV on the peer (same message kind, same microbatch)
        and vice versa;
      * the stages can run to completion (:func:`execution_order`).

    Raises:
      ValueError: naming the first violated rule, the stage and the action.
      ScheduleDeadlock: if the structure is fine but the lists wait on each other in a cycle.
    """
    S = len(actions_per_stage)
    if S == 0:
        raise ValueError("a schedule needs at least one stage")
    mbs = [a.microbatch for acts in actions_per_stage for a in acts]
    M = max(mbs) + 1 if mbs else 0
    if M == 0:
        raise ValueError("a schedule needs at least one microbatch")
    sends: Dict[tuple, int] = {}
    recvs: Dict[tuple, int] = {}
    for s, acts in enumerate(actions_per_stage):
        pos: Dict[Tuple[ActionKind, int], int] = {}
        for i, a in enumerate(acts):
            if (a.kind, a.microbatch) in pos:
                raise ValueError(f"stage {s}: {a} appears more than once (positions "
                                 f"{pos[(a.kind, a.microbatch)]} and {i}); each microbatch needs exactly "
                                 f"one of each action per stage")
            pos[(a.kind, a.microbatch)] = i
            if not a.is_compute:
                want = s + 1 if a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_GRAD) else s - 1
                if a.peer != want:
                    raise ValueError(f"stage {s}: {a} must have peer stage {want} (adjacent stages only)")
                if not 0 <= a.peer < S:
                    raise ValueError(f"stage {s}: {a} names peer stage {a.peer}, which does not exist "
                                     f"({S} stages)")
                (sends if a.is_send else recvs)[message_key(s, a)] = s
        for mb in range(M):
            for kind in (ActionKind.F, ActionKind.B):
                if (kind, mb) not in pos:
                    raise ValueError(f"stage {s}: missing {kind}{mb}; every microbatch 0..{M - 1} needs "
                                     f"exactly one F and one B on every stage")
            f, b = pos[(ActionKind.F, mb)], pos[(ActionKind.B, mb)]
            if b < f:
                raise ValueError(f"stage {s}: B{mb} (position {b}) runs before F{mb} (position {f}); "
                                 f"every forward must precede its backward")
            # (kind, required?, must come before (True) or after (False) the compute at position)
            comm_rules = [(ActionKind.RECV_ACT, s > 0, True, f), (ActionKind.SEND_ACT, s < S - 1, False, f),
                          (ActionKind.RECV_GRAD, s < S - 1, True, b), (ActionKind.SEND_GRAD, s > 0, False, b)]
            for kind, needed, before, at in comm_rules:
                p = pos.get((kind, mb))
                if needed and p is None:
                    raise ValueError(f"stage {s}: missing {kind} of microbatch {mb}")
                if not needed and p is not None:
                    raise ValueError(f"stage {s}: unexpected {acts[p]} (stage {s} of {S} has no such peer)")
                if p is not None and (p > at if before else p < at):
                    which = "before" if before else "after"
                    raise ValueError(f"stage {s}: {acts[p]} (position {p}) must come {which} the compute "
                                     f"of microbatch {mb} (position {at})")
    for key, s in sends.items():
        if key not in recvs:
            raise ValueError(f"SEND without matching RECV: {key[0].replace('RECV', 'SEND')} of microbatch "
                             f"{key[3]} from stage {key[1]} to stage {key[2]} is never received")
    for key, s in recvs.items():
        if key not in sends:
            raise ValueError(f"RECV without matching SEND: {key[0]} of microbatch {key[3]} on stage "
                             f"{key[2]} from stage {key[1]} is never sent")
    execution_order(actions_per_stage)


def execution_order(actions_per_stage: Sequence[Sequence[Action]]) -> List[Tuple[int, int]]:
    """A global, deadlock-free interleaving of all stages' actions.

    Sweeps the stages in index order; each stage runs its next actions while they are ready (F, B and
    SEND are always ready; a RECV is ready once the matching SEND, same kind pair, peer and microbatch,
    has run), then the sweep moves to the next stage; sweeps repeat until every list is done. The result
    is deterministic. A single-process runtime can execute the stages in exactly this order.

    Returns:
      list of ``(stage, index)`` pairs: ``actions_per_stage[stage][index]`` is the next action to run.
    Raises:
      ScheduleDeadlock: if in a full sweep no stage can run, naming each stuck stage's waiting action.
    """
    S = len(actions_per_stage)
    nxt = [0] * S
    sent = set()
    order: List[Tuple[int, int]] = []
    total = sum(len(a) for a in actions_per_stage)
    while len(order) < total:
        progressed = False
        for s in range(S):
            acts = actions_per_stage[s]
            while nxt[s] < len(acts):
                a = acts[nxt[s]]
                if a.is_recv and message_key(s, a) not in sent:
                    break
                if a.is_send:
                    sent.add(message_key(s, a))
                order.append((s, nxt[s]))
                nxt[s] += 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} at {actions_per_stage[s][nxt[s]]} (position {nxt[s]})"
                     for s in range(S) if nxt[s] < len(actions_per_stage[s])]
            raise ScheduleDeadlock("schedule deadlock: no stage can progress; waiting: " + "; ".join(stuck))
    return order
