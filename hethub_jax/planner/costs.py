"""Cost models of one device type, from a profile or from the catalog (pure Python + numpy, no JAX).

:class:`DeviceCosts` answers "how many seconds does this piece of a step take on this device type":
a decoder layer's forward or backward, the embedding, the LM head + loss, the fixed per-action cost of
a stage call, the optimizer update and the in-island all-reduce. :class:`LinkModel` times a message
over a link, ``alpha + bytes / bandwidth`` (Hockney 1994, "The communication challenge for MPP: Intel
Paragon and Meiko CS-2", the alpha-beta model).

Phases (what one pipeline action computes, ``hethub_jax.parallel.stage``):
  * ``"F"``: forward that saves the ``jax.vjp`` residuals (``forward_saving``; recompute ``none``);
  * ``"F_nosave"``: plain forward (``forward``; recompute ``full``);
  * ``"B"``: backward from the saved residuals (``backward_saved``);
  * ``"B_recompute"``: backward that recomputes the forward first (``backward_recompute``); also the
    fused forward + backward of the last stage (``forward_backward``: the same work).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from hethub_jax.planner import analytic
from hethub_jax.planner.catalog import DeviceSpec, get_device

__all__ = ["PHASES", "LinkModel", "DeviceCosts", "PROFILE_FORMAT", "cost_source_text", "CORUN_BY_SIZE_DEFAULT",
           "BRIDGE_ALLREDUCE_FILE", "BRIDGE_ALLREDUCE_FORMAT", "read_bridge_allreduce", "bridge_allreduce_text"]

PHASES = ("F", "F_nosave", "B", "B_recompute")
#: ``format`` field of profile JSON files written by ``python -m hethub_jax.profile``
PROFILE_FORMAT = "hethub-jax-profile/1"
#: work of each phase in forwards (Narayanan et al. 2021, section 5.1: backward = 2 forwards)
_PHASE_FORWARDS = {"F": 1.0, "F_nosave": 1.0, "B": analytic.BACKWARD_FLOPS_FACTOR,
                   "B_recompute": 1.0 + analytic.BACKWARD_FLOPS_FACTOR}
#: all-reduces of T x D activations per layer and phase under Megatron TP (Shoeybi et al. 2019,
#: section 3: f and g operators, 2 in the forward, 2 in the backward, 4 when the forward is recomputed)
_PHASE_TP_ALLREDUCES = {"F": 2, "F_nosave": 2, "B": 2, "B_recompute": 4}


#: THE one place that decides, per kind of island sharing a CPU host's cores, whether the predictor slows their
#: overlapping compute by the profile's MEASURED co-run slowdown by the pair's size ratio (``fits.corun.relation``:
#: True) or by its one MEASURED factor (``fits.corun.factor``: False); read by :meth:`DeviceCosts.on_shared_host`
#: (``"processes"``: islands that are processes of their own, as ``hethub_jax.train`` and
#: ``benchmarks/predictor_accuracy.py`` run them) and :meth:`DeviceCosts.in_process` (``"threads"``: islands that
#: are threads of one process, ``predictor_accuracy.py --islands threads``), unless the caller chose with
#: ``corun_by_size``. Sources (docs/benchmarks.md, issue 13): with the islands as processes and the relation measured
#: beside a neighbour PROCESS, the quiet run of 2026-12-03 08:16 (5e008b3, /work/bench/s14/predictor_accuracy.json)
#: gave mape 7.6% by size ratio against 11.9% with the one factor, closer on all 11 rows (session 15 recomputed it
#: from the JSON); with the islands as threads the quiet run of 2026-12-03 05:30 gave 19.6% against 19.4%
#: (the one factor as close or closer on 7 of 11 rows; session 13) and 20.8% against 17.2% in session 14.
#: Session 15 made the relation the default for processes on that one run, and its two quiet runs on the merged
#: main (2026-12-03 11:13 and 11:46, /work/bench/s15/predictor_accuracy_{1,2}.json) then gave the opposite:
#: 9.4% by size ratio against 7.0% with the one factor, and 16.8% against 12.7%. One run for, two against: the
#: one measured factor is the default for both kinds again; the relation stays the in-run comparison.
CORUN_BY_SIZE_DEFAULT: Dict[str, bool] = {"processes": False, "threads": False}


def _check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


@dataclass(frozen=True)
class LinkModel:
    """A point-to-point link: ``time_s(nbytes) = alpha_s + nbytes / bandwidth`` (seconds).

    Attributes:
      alpha_s: latency per message, seconds (>= 0).
      bandwidth: bytes/s (> 0).

    Raises:
      ValueError: if ``alpha_s < 0`` or ``bandwidth <= 0``.
    """

    alpha_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and self.bandwidth > 0):
            raise ValueError(f"LinkModel needs alpha_s >= 0 and bandwidth > 0, got {self.alpha_s}, {self.bandwidth}")

    def time_s(self, nbytes: float) -> float:
        return self.alpha_s + float(nbytes) / self.bandwidth


@dataclass(frozen=True)
class _Linear:
    """``c0 + c1 * x`` (seconds), fitted by least squares in the profile."""

    c0: float
    c1: float

    def __call__(self, x: float) -> float:
        return max(0.0, self.c0 + self.c1 * x)


@dataclass(frozen=True)
class DeviceCosts:
    """The cost model of ONE device type (build with :meth:`from_catalog` or :meth:`from_profile`).

    Attributes:
      name: device type (catalog key or the profile's ``device_type``).
      source: ``"profile"`` (measured) or ``"catalog"`` (datasheet x efficiency).
      memory_bytes: memory capacity per device, bytes.
      emulated_slowdown: the emulated slowdown the profile's times include (DESIGN.md section 9; 1.0
        for the catalog); the predictor rescales by ``island.slowdown / emulated_slowdown``.
      spec: the catalog entry (catalog costs) or None.
      efficiency: fraction of the datasheet peaks assumed reachable (catalog costs), else None.
      fits: per TP degree (int) and phase, the fitted ``{"layer", "embed", "head", "base"}`` lines
        (profile costs; x is FLOPs for layer and head, tokens for embed, 1 for base).
      update_fit, allreduce_fit, shared_sum_fit, host_link: fitted lines of the update (x = parameters
        per device), the in-island all-reduce (x = bytes), the runtime's host-side sum of shared
        gradients (x = bytes over holders) and the device <-> host copy (profile costs).
      bridge_link: the MPI bridge measured by the profiler under ``mpiexec -n 2`` (None when not
        measured); pass it to ``predict(..., bridge=...)``.
      profile: the raw profile dict (profile costs).
      corun_factor: MEASURED slowdown of a computation while a second island of the same process
        computes on other devices of the same host (``fits.corun.factor`` of a CPU profile: fake CPU
        devices of one process share its cores); 1.0 when not measured (the catalog, separate hardware).
      corun_relation: MEASURED co-run slowdown by the size of the pair (``fits.corun.relation``,
        ``profile.measure_corun``): ``((size_ratio, extra), ...)`` sorted by ``size_ratio`` = a call's
        alone seconds / its neighbour's alone seconds per call, ``extra`` = busy / alone - 1 beside
        that neighbour (>= 0); empty when not measured or not asked for (``from_profile``'s
        ``corun_by_size``; :meth:`on_shared_host` reads it by default, :meth:`in_process` does not:
        :data:`CORUN_BY_SIZE_DEFAULT`), then ``corun_factor - 1`` at every ratio (:meth:`corun_extra`).
      corun_update_factor: MEASURED slowdown of an island's optimizer update while another island of the
        host updates at the same time (``fits.corun_update.factor``: after the pipelines the islands start
        their updates together, and AdamW is bound by the memory bandwidth and cores they share): the
        updates of a two-island ``PipelineRuntime`` step together over one at a time
        (``profile.measure_tail_pair``), or in older profiles two warm updates started by a barrier
        (``profile.measure_update_pair``); 0.0 when not measured (the predictor then uses ``corun_factor``).
      host: name of the host whose cores the islands with these costs share (None: the island has
        hardware of its own). Set with :meth:`on_shared_host`; the predictor slows the overlapping
        compute of islands with the same ``host`` by :meth:`corun_extra` (``corun_relation``, else
        ``corun_factor``).
      dp_fits: per ``(dp, tp)`` mesh with ``dp > 1`` that was profiled, fits like ``fits`` (x = the
        FLOPs / tokens per DP rank): on CPU the fake devices of a mesh share the same cores, so a DP
        mesh is measured, not derived from one device with fewer tokens.
      update_dp_fits: per DP degree > 1 that was profiled, the update fit on such a mesh.
      update_tp_fits: per TP degree > 1 that was profiled, the update fit on a ``(1, tp)`` mesh (x =
        parameters per device): MEASURED, not one device's fit at 1/tp of the parameters (fake CPU
        devices of one process share the host's cores; ``fits.update_tp`` of a profile).
      norm_mesh_fits: per profiled stage mesh ``(dp, tp)`` other than ``(1, 1)``, the MEASURED line of
        the stage's ``sq_norm`` (x = parameters per device; ``fits.norm_mesh`` of a profile), used by
        :meth:`norm_time_s` for such meshes.
      action_overhead_s: the runtime's own seconds per action (Python dispatch and bookkeeping
        around the compute calls), MEASURED on ``PipelineRuntime`` by the profiler (``fits.runtime``);
        0 for the catalog (an assumption: negligible against a large model's compute).
      profile_path: the profile file read (:meth:`from_profile` given a path), else None.
      local_bridge_link: the bridge between islands that are threads of ONE process
        (``LocalCommunicator``), from the profile's measured 2-thread all-reduce ``c0 + c1 x bytes``
        (``fits.bridge_local``) as ``LinkModel(c0 / 2, 1 / c1)``, so that the predictor's ring
        all-reduce of 2 islands, ``2 alpha + bytes / bandwidth``, is the measured one; None when not
        measured.
      cold_extra: per stage position (``"first"``, ``"middle"``, ``"last"``) and phase, the MEASURED
        extra seconds (>= 0) of a call right after another stage's call over right after itself
        (``fits.cold`` of a profile, ``profile.measure_cold``: the call finds its code and data
        evicted from the CPU caches); the compute fits time calls back to back, so the predictor
        adds it to a call that follows a different call (:meth:`cold_extra_s`). Empty (0 s) for the
        catalog and for profiles without the measurement.
      norm_fit: MEASURED seconds of one stage's contribution to the global gradient norm as the runtime
        computes it after the gradient sums (``PipelineStage.sq_norm`` of the gradients the stage
        counts, and the read of its scalar): ``c0 + c1 x counted parameters`` (``fits.norm`` of a
        profile, ``profile.measure_shared_sum``); None: :meth:`norm_time_s` derives it from the update.
      update_cold_per_param_s: MEASURED extra seconds per parameter of the optimizer update as the
        runtime runs it, right after the step's pipeline and gradient sums, over the update fit (timed
        back to back): ``fits.update_cold.per_param_s`` of a profile (``profile.fit_update_cold``);
        0 for the catalog and for profiles without the measurement.
      update_runtime_scale: MEASURED ratio of the runtime's own update call (``PipelineRuntime._update_fn``,
        under ZeRO-1 ``PipelineStage.owned_update``, repeated at once after a step) to the ``update`` fit
        (``PipelineStage.update`` of the profiled stage kinds, back to back) for the same parameters:
        ``fits.update_runtime.scale`` of a profile (``profile.fit_update_runtime``; computed from the
        profile's ``update_in_step`` samples and ``update`` fit when the profile predates the fit);
        1.0 for the catalog and for profiles without the samples. Multiplies the one-device update fit
        (:meth:`update_time_s`).
      action_costs: the runtime's MEASURED seconds of the pipeline actions that compute nothing
        (``fits.actions`` of a profile, ``profile.measure_action_costs``: read from the records of a
        one-island ``PipelineRuntime`` step): ``send_s`` (a SEND record: hand the activation to the
        mailbox), ``recv_s`` (a RECV record: place the arrived message on the stage's sharding),
        ``fused_b_s`` (the B record of a last stage whose B was computed with its F: Python only) and
        ``gap_s`` (the runtime's seconds between one action's record and the next, per action).
        Empty for the catalog and for older profiles (then :attr:`action_overhead_s` is added to
        every action instead, :meth:`between_actions_s`).
      emulated_wait_fit: the MEASURED seconds of the runtime's emulated wait
        (``runtime.emulated_wait``, a sleep) asked to wait ``x`` seconds, ``c0 + c1 x``
        (``fits.emulated_wait``, ``profile.measure_emulated_wait``: a sleep wakes late); None: a wait
        takes exactly what it is asked (catalog, older profiles).
      stage_shapes: per MEASURED whole-stage shape ``(layers, is_first, is_last, dp, tp, phase)``, the
        ``(tokens per DP rank, seconds)`` points of the profile's ``"stage_shape"`` samples, tokens
        ascending (``python -m hethub_jax.profile --stage-shapes``); read by :meth:`measured_stage_s`.
        Empty for the catalog and for profiles without them.
      serial_launch: MEASURED: one process runs its multi-device computations (a stage mesh of more
        than one device) one at a time, first come first served, whatever devices they use
        (``fits.launch.serial`` of a profile, ``profile.measure_launch``). XLA:CPU's PjRt client does
        so by design: ``PjRtCpuLoadedExecutable::Execute`` in ``xla/pjrt/cpu/cpu_client.cc`` makes
        each multi-device launch wait for the previous one ("We conservatively run only one
        collective at a time"); a one-device computation runs on the calling thread without waiting.
        False for the catalog and for profiles without the measurement.
      shared_sum_mesh: per stage mesh ``(dp, tp)`` other than ``(1, 1)`` that was profiled, the MEASURED
        ratio of the runtime's gradient sums of the tied embedding (``_reduce_shared``: host copy, sum,
        placement of every gradient leaf back onto the stage's sharding) with the stages on that mesh over
        on one device each (``fits.shared_sum_mesh``, ``profile.measure_shared_sum_mesh``); it scales
        :meth:`shared_sum_s` for holders on that mesh. Empty: 1 (catalog, older profiles).
      in_flight: per stage position (``"first"``, ``"last"``; ``"middle"`` if measured) and phase, the
        MEASURED factor of a stage call's seconds as the runtime makes it with ``n`` microbatches in
        flight (forwards run whose backward has not, its own included) over the same call alone (what
        the compute fits time): ``((n, factor), ...)`` ascending in ``n`` (``fits.in_flight`` of a
        profile, ``profile.measure_in_flight``: a one-island GPipe and 1F1B runtime's F and B actions
        against the calls alone, process CPU seconds); read by :meth:`in_flight_factor`. Empty (factor
        1) for the catalog and for profiles without the measurement.
      process: name of the process whose islands given costs with the same ``process`` are threads
        of (None: each island is a process of its own). Set with :meth:`in_process`; with
        :attr:`serial_launch` the predictor runs those islands' multi-device compute actions one
        at a time.
      bridge_allreduce_fit: MEASURED seconds of the MPI host bridge's all-reduce of ``x`` bytes between TWO island
        processes as the runtime calls it (``MPIHostBridge.allreduce_tree`` of float32 host arrays, both entering
        together; ``c0 + c1 x``): the cross-island sum of the shared gradients (``PipelineRuntime._reduce_shared``).
        Set with :meth:`with_bridge_allreduce` (``benchmarks/predictor_accuracy.py`` measures it beside the bridge's
        ping-pong) or read from a profile's ``fits.bridge_allreduce``; None: the predictor's ring formula over the
        bridge's point-to-point line. Why (docs/benchmarks.md, issue 13, session 15): an 8.2 MB all-reduce took
        6.6x one 8.2 MB transfer of the same bridge (14.5-14.8 ms against 2.2 ms, LOADED machine, 2026-12-03
        10:16), where the ring formula gives 2 alpha + bytes / bandwidth, about 1.7 ms quiet.
      corun_by_size: the caller's choice of co-run model in :meth:`from_profile` (True: the relation by
        size ratio, False: the one factor), None when left to the island kind (:data:`CORUN_BY_SIZE_DEFAULT`,
        applied by :meth:`on_shared_host` / :meth:`in_process`).
    """

    name: str
    source: str
    memory_bytes: int
    emulated_slowdown: float = 1.0
    spec: Optional[DeviceSpec] = None
    efficiency: Optional[float] = None
    fits: Dict[int, Dict[str, Dict[str, _Linear]]] = field(default_factory=dict)
    update_fit: Optional[_Linear] = None
    allreduce_fit: Optional[_Linear] = None
    shared_sum_fit: Optional[Tuple[float, float]] = None
    host_link: Optional[LinkModel] = None
    bridge_link: Optional[LinkModel] = None
    profile: Optional[Dict[str, Any]] = None
    corun_factor: float = 1.0
    corun_update_factor: float = 0.0
    corun_relation: Tuple[Tuple[float, float], ...] = ()
    host: Optional[str] = None
    dp_fits: Dict[Tuple[int, int], Dict[str, Dict[str, _Linear]]] = field(default_factory=dict)
    update_dp_fits: Dict[int, _Linear] = field(default_factory=dict)
    update_tp_fits: Dict[int, _Linear] = field(default_factory=dict)
    norm_mesh_fits: Dict[Tuple[int, int], _Linear] = field(default_factory=dict)
    action_overhead_s: float = 0.0
    profile_path: Optional[str] = field(default=None, compare=False)
    local_bridge_link: Optional[LinkModel] = None
    cold_extra: Dict[str, Dict[str, float]] = field(default_factory=dict)
    norm_fit: Optional[_Linear] = None
    update_cold_per_param_s: float = 0.0
    update_runtime_scale: float = 1.0
    action_costs: Dict[str, float] = field(default_factory=dict)
    emulated_wait_fit: Optional[_Linear] = None
    shared_sum_mesh: Dict[Tuple[int, int], float] = field(default_factory=dict)
    in_flight: Dict[str, Dict[str, Tuple[Tuple[int, float], ...]]] = field(default_factory=dict)

    def in_flight_factor(self, is_first: bool, is_last: bool, phase: str, count: int) -> float:
        """Factor (> 0) of an unfused stage call's seconds (phase in :data:`PHASES`) when ``count``
        microbatches are in flight on its stage (forwards run whose backward has not, the call's own
        microbatch included; ``count`` >= 1), from the MEASURED :attr:`in_flight` points of the
        stage's position (``"last"`` for a last stage, ``"first"`` for a first, else ``"middle"``,
        and a middle stage without its own points takes the first stage's: both lack the LM head):
        linear in ``count`` between measured counts, the end points' factor beyond them; 1.0 when
        not measured (catalog, older profiles).

        Why: under GPipe a stage holds every microbatch's residuals until its backwards and a last
        stage runs F and B unfused; the runtime's calls then cost more than the same calls alone
        (docs/benchmarks.md, issue 13, session 13).

        Raises:
          ValueError: for an unknown phase or ``count < 1``.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        pts = self.in_flight_points(is_first, is_last, phase)
        if not pts:
            return 1.0
        if count <= pts[0][0]:
            return pts[0][1]
        for (n0, f0), (n1, f1) in zip(pts, pts[1:]):
            if count <= n1:
                return f0 + (f1 - f0) * (count - n0) / (n1 - n0)
        return pts[-1][1]

    def in_flight_points(self, is_first: bool, is_last: bool, phase: str) -> Tuple[Tuple[int, float], ...]:
        """The MEASURED ``((count, factor), ...)`` of :attr:`in_flight` that :meth:`in_flight_factor` reads
        for a stage at that position and phase (a middle stage without points: the first stage's); ()
        when not measured.

        Raises:
          ValueError: for an unknown phase."""
        _check_phase(phase)
        pos = "last" if is_last else "first" if is_first else "middle"
        by_phase = self.in_flight.get(pos) or (self.in_flight.get("first") if pos == "middle" else None) or {}
        return tuple(by_phase.get(phase, ()))

    def between_actions_s(self) -> float:
        """Seconds the runtime spends between two actions' records, per action: the measured
        ``action_costs["gap_s"]``; for profiles without it :attr:`action_overhead_s` (which also holds
        the SEND and RECV records, spread over every action); 0 for the catalog."""
        if "gap_s" in self.action_costs:
            return max(0.0, float(self.action_costs["gap_s"]))
        return float(self.action_overhead_s)

    def message_action_s(self, kind: str) -> float:
        """Measured seconds of a SEND (``kind="send"``) or RECV (``"recv"``) record of the runtime,
        not counting a copy between device and host (:meth:`host_copy_s`); a last stage's B computed
        with its F (``"fused_b"``), before any emulated slowdown; 0.0 when not measured.

        Raises:
          ValueError: for another kind."""
        if kind not in ("send", "recv", "fused_b"):
            raise ValueError(f"kind must be 'send', 'recv' or 'fused_b', got {kind!r}")
        return max(0.0, float(self.action_costs.get(f"{kind}_s", 0.0)))

    def emulated_action_s(self, busy_s: float, slowdown: float) -> float:
        """Seconds of a compute action (or update) whose own time in this profile's figures is
        ``busy_s`` on an island EMULATED ``slowdown`` x slower (DESIGN.md section 9; the runtime's
        ``PipelineRuntime._emulate``): the action's real time ``r = busy_s / emulated_slowdown``, then,
        when ``slowdown > 1``, the runtime's wait of ``(slowdown - 1) x r``, which takes
        :attr:`emulated_wait_fit` of that (a sleep wakes late) or exactly that when not measured.
        Linear in ``busy_s``; ``slowdown x r`` without a wait fit."""
        r = float(busy_s) / self.emulated_slowdown
        if slowdown <= 1:
            return r
        wait = (float(slowdown) - 1.0) * r
        return r + (wait if self.emulated_wait_fit is None else self.emulated_wait_fit(wait))

    stage_shapes: Dict[Tuple[int, bool, bool, int, int, str], Tuple[Tuple[float, float], ...]] = field(
        default_factory=dict)
    serial_launch: bool = False
    process: Optional[str] = None
    corun_by_size: Optional[bool] = None
    bridge_allreduce_fit: Optional[_Linear] = None
    #: per profiled ``(dp, tp, phase)``, the MEASURED parts at each profiled token count: ``(tokens, base,
    #: layer, embed, head)`` seconds, tokens ascending, solved exactly from the four profiled stage kinds at
    #: that count (:func:`_token_parts`); read by :meth:`_token_part`. Empty for the catalog and for
    #: profiles whose samples lack the stage kinds.
    token_parts: Dict[Tuple[int, int, str], Tuple[Tuple[float, float, float, float, float], ...]] = field(
        default_factory=dict)

    def _token_part(self, tp: int, phase: str, part: str, dp: int, tokens: Optional[float]) -> Optional[float]:
        """Seconds of ``part`` (``"base"``, ``"layer"``, ``"embed"`` or ``"head"``) for ``tokens`` tokens per
        DP rank on a PROFILED ``(dp, tp)`` mesh, linear between the two profiled token counts around
        ``tokens`` (:attr:`token_parts`, the profile's own samples at each count); None outside the
        profiled counts, for an unprofiled mesh or without ``tokens`` (the caller uses the fitted line).

        Why: the fitted lines are linear in FLOPs, i.e. in tokens, and a microbatch size between two
        profiled ones was interpolated along them; on this CPU the seconds per token are not constant
        (the last stage's logits are 8 MB per sample and outgrow the caches): the runtime's calls at
        microbatch 2 took 0.80-1.00x (median over calls and stage kinds about 0.9x) the straight line
        between microbatch 1 and 4 (docs/benchmarks.md, issue 13, session 12). Profiling the sizes a plan
        uses and interpolating between them follows the measured curve."""
        if tokens is None:
            return None
        pts = self.token_parts.get((int(dp), int(tp), phase))
        if not pts or not pts[0][0] <= tokens <= pts[-1][0]:
            return None
        j = {"base": 1, "layer": 2, "embed": 3, "head": 4}[part]
        for a, b in zip(pts, pts[1:]):
            if a[0] <= tokens <= b[0]:
                return a[j] + (b[j] - a[j]) * (tokens - a[0]) / (b[0] - a[0])
        return pts[0][j]  # one profiled count, equal to tokens

    def measured_stage_s(self, layers: int, is_first: bool, is_last: bool, tokens: float, tp: int, phase: str,
                         dp: int = 1) -> Optional[float]:
        """Seconds of one call of phase ``phase`` of a stage of ``layers`` decoder layers (with the
        embedding when ``is_first``, the LM head and loss when ``is_last``) on a ``(dp, tp)`` mesh for
        ``tokens`` tokens per DP rank, from the profile's MEASURED whole stages of that shape
        (:attr:`stage_shapes`): the measured seconds at a profiled token count, else linear between the
        two profiled counts around ``tokens``; None when that shape, mesh and phase were not measured or
        ``tokens`` lies outside the measured counts (the caller then uses the fitted lines: no
        extrapolation). Every decoder layer costs the same, so the shape is the layer count and the
        two ends, not the layer indices. No slowdown applied (the profile's own, as the fits).

        Raises:
          ValueError: for an unknown phase.
        """
        _check_phase(phase)
        pts = self.stage_shapes.get((int(layers), bool(is_first), bool(is_last), int(dp), int(tp), phase))
        if not pts or not pts[0][0] <= tokens <= pts[-1][0]:
            return None
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x0 <= tokens <= x1:
                return y0 if x1 == x0 else y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        return pts[0][1]  # one measured count, equal to tokens

    def cold_extra_s(self, is_first: bool, is_last: bool, phase: str) -> float:
        """The measured :attr:`cold_extra` seconds of a stage call (phase in :data:`PHASES`; a last
        stage's fused forward + backward is ``"B_recompute"``): position ``"last"`` for a last stage
        (also a one-stage plan's stage, whose calls are the fused ones), ``"first"`` for a first
        stage, else ``"middle"``; 0.0 when not measured.

        Raises:
          ValueError: for an unknown phase."""
        _check_phase(phase)
        pos = "last" if is_last else "first" if is_first else "middle"
        return max(0.0, float(self.cold_extra.get(pos, {}).get(phase, 0.0)))

    def corun_extra(self, size_ratio: float) -> float:
        """Fraction by which a computation of these costs is slowed while another island of its host
        computes a call ``size_ratio`` times shorter than it (its alone seconds / the neighbour's
        alone seconds, > 0): the MEASURED :attr:`corun_relation` interpolated linearly in
        ``log(size_ratio)`` between its points and held at its end points beyond them (the measured
        pairs span the pipeline's: a first stage's small calls beside a last stage's fused F+B and
        the reverse); ``corun_factor - 1`` at every ratio when the relation was not measured.

        Raises:
          ValueError: if ``size_ratio <= 0``.
        """
        if not size_ratio > 0:
            raise ValueError(f"size_ratio must be > 0, got {size_ratio}")
        pts = self.corun_relation
        if not pts:
            return max(0.0, self.corun_factor - 1.0)
        if size_ratio <= pts[0][0]:
            return pts[0][1]
        if size_ratio >= pts[-1][0]:
            return pts[-1][1]
        x = math.log(size_ratio)
        for (r0, e0), (r1, e1) in zip(pts, pts[1:]):
            if size_ratio <= r1:
                w = (x - math.log(r0)) / (math.log(r1) - math.log(r0))
                return e0 + w * (e1 - e0)
        return pts[-1][1]

    def on_shared_host(self, host: str = "local", corun_by_size: Optional[bool] = None) -> "DeviceCosts":
        """A copy whose islands are PROCESSES sharing the cores of host ``host`` with the other islands
        given costs with the same ``host`` (as ``hethub_jax.train`` and ``benchmarks/predictor_accuracy.py``
        run CPU islands); their overlapping compute is slowed by the MEASURED co-run slowdown
        (:meth:`corun_extra`).

        ``corun_by_size``: slow it by the profile's co-run relation by the pair's size ratio
        (``fits.corun.relation`` into :attr:`corun_relation`; True) or by the one factor
        ``fits.corun.factor`` (False). None: the choice made in :meth:`from_profile` if one was made there,
        else :data:`CORUN_BY_SIZE_DEFAULT` ``["processes"]`` (False: the one measured factor; session 15 tried True, see there). Costs without a
        measured relation (the catalog, profiles made with ``--corun off`` or before session 12) keep the one
        factor either way.

        Raises:
          ValueError: if ``host`` is empty.
        """
        if not host:
            raise ValueError("host must be a non-empty name")
        return replace(self, host=str(host), corun_relation=self._corun_relation_for("processes", corun_by_size))

    def in_process(self, process: str = "local", corun_by_size: Optional[bool] = None) -> "DeviceCosts":
        """A copy whose islands are threads of ONE process, ``process``, with the other islands given
        costs with the same ``process`` (``benchmarks/predictor_accuracy.py --islands threads``: one thread
        per island): they share that host's cores (:meth:`on_shared_host` with the same name) and, where the
        profile measured :attr:`serial_launch`, its launcher of multi-device computations.
        ``corun_by_size`` as in :meth:`on_shared_host`; None: the choice made in :meth:`from_profile`, else
        :data:`CORUN_BY_SIZE_DEFAULT` ``["threads"]`` (False: the one measured factor).

        Raises:
          ValueError: if ``process`` is empty.
        """
        if not process:
            raise ValueError("process must be a non-empty name")
        return replace(self, host=str(process), process=str(process),
                       corun_relation=self._corun_relation_for("threads", corun_by_size))

    def with_bridge_allreduce(self, fit: Optional[Mapping[str, float]]) -> "DeviceCosts":
        """A copy with :attr:`bridge_allreduce_fit` ``fit["c0"] + fit["c1"] x bytes`` (seconds; None: unset); a
        negative least-squares intercept is kept (the line is evaluated at no less than 0 s, as the other fits).

        Raises:
          ValueError: if ``c0`` or ``c1`` is not finite or ``c1`` is negative."""
        if fit is None:
            return replace(self, bridge_allreduce_fit=None)
        c0, c1 = float(fit["c0"]), float(fit["c1"])
        if not (math.isfinite(c0) and math.isfinite(c1) and c1 >= 0):
            raise ValueError(f"bridge all-reduce line needs finite c0 and c1 >= 0, got {c0}, {c1}")
        return replace(self, bridge_allreduce_fit=_Linear(c0, c1))

    def bridge_allreduce_s(self, nbytes: float) -> Optional[float]:
        """MEASURED seconds of the bridge's all-reduce of ``nbytes`` bytes between two island processes
        (:attr:`bridge_allreduce_fit`), None when not measured."""
        return None if self.bridge_allreduce_fit is None else self.bridge_allreduce_fit(float(nbytes))

    def _corun_relation_for(self, islands: str, corun_by_size: Optional[bool]) -> Tuple[Tuple[float, float], ...]:
        """The :attr:`corun_relation` of islands of kind ``islands`` (a key of :data:`CORUN_BY_SIZE_DEFAULT`):
        the profile's measured relation when ``corun_by_size`` (else :attr:`corun_by_size`, else the kind's
        default) is True, else empty (the one factor)."""
        choice = corun_by_size if corun_by_size is not None else self.corun_by_size
        if choice is None:
            choice = CORUN_BY_SIZE_DEFAULT[islands]
        if not choice:
            return ()
        measured = _corun_relation(((self.profile or {}).get("fits") or {}).get("corun"))
        return measured or self.corun_relation

    # ---- constructors ------------------------------------------------------------------------------
    @classmethod
    def from_catalog(cls, spec: Union[DeviceSpec, str], efficiency: float = 0.4) -> "DeviceCosts":
        """Costs from datasheet figures: compute at ``efficiency x peak_flops``, memory traffic at
        ``efficiency x memory_bandwidth``, links at their datasheet bandwidth with a stated latency
        (5 us inside a node, 10 us over the network: typical NCCL small-message latencies, an
        assumption). ``efficiency`` 0.4 is a typical MFU of large-model training (Narayanan et al.
        2021 report 0.44-0.52 of peak on A100 for GPT models of 1-1000 B parameters; Chowdhery et al.
        2022, PaLM, 0.46): a stated assumption, profile the device to replace it.

        Raises:
          ValueError: if ``efficiency`` is not in (0, 1], or for an unknown device name.
        """
        if isinstance(spec, str):
            spec = get_device(spec)
        if not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
        return cls(name=spec.name, source="catalog", memory_bytes=int(spec.memory_bytes), spec=spec,
                   efficiency=float(efficiency),
                   host_link=LinkModel(5e-6, spec.intra_node_bandwidth))

    @classmethod
    def from_profile(cls, profile: Union[Mapping[str, Any], str, os.PathLike],
                     corun_by_size: Optional[bool] = None) -> "DeviceCosts":
        """Costs from a profile written by ``python -m hethub_jax.profile`` (a dict or a JSON path).

        ``corun_by_size``: True reads the profile's co-run slowdown by the pair's size ratio
        (``fits.corun.relation`` into :attr:`corun_relation`) now and keeps it when the costs are put on a
        host; False keeps the one MEASURED factor ``fits.corun.factor`` there; None (default): the relation
        is not read here (the costs are not on a shared host yet, where no co-run applies) and
        :meth:`on_shared_host` (islands as processes: by size ratio) or :meth:`in_process` (islands as
        threads: the one factor) decides by :data:`CORUN_BY_SIZE_DEFAULT`, which gives the measurements
        behind each choice. The relation's points (one small call's slowdown beside a large one) are the
        noisier measurement: 1.1-5.5x between consecutive measurements of the same pair on the shared
        machine, against 1.1-1.6x for the factor's large pair (session 13).

        Raises:
          ValueError: if the profile's ``format`` is not :data:`PROFILE_FORMAT` or a fit is missing.
          OSError: if the file cannot be read.
        """
        path = None if isinstance(profile, Mapping) else os.fspath(profile)
        if not isinstance(profile, Mapping):
            with open(profile) as f:
                profile = json.load(f)
        if profile.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a {PROFILE_FORMAT} profile (format {profile.get('format')!r})")
        fits_in = profile.get("fits", {})
        if "compute" not in fits_in:
            raise ValueError("profile has no 'fits.compute' section")
        lines = lambda phases: {ph: {part: _Linear(float(v["c0"]), float(v["c1"])) for part, v in parts.items()}
                                for ph, parts in phases.items()}
        fits = {int(tp): lines(phases) for tp, phases in fits_in["compute"].items()}
        dp_fits = {tuple(int(x) for x in mesh.split("x")): lines(phases)
                   for mesh, phases in (fits_in.get("compute_dp") or {}).items()}
        lin = lambda d: None if d is None else _Linear(float(d["c0"]), float(d["c1"]))
        host, br = fits_in.get("host_copy"), fits_in.get("bridge")
        link = lambda d: None if d is None else LinkModel(max(0.0, float(d["c0"])), 1.0 / max(float(d["c1"]), 1e-15))
        return cls(name=str(profile.get("device_type", "cpu")), source="profile",
                   memory_bytes=int(profile.get("memory_bytes", get_device("cpu").memory_bytes)),
                   emulated_slowdown=float(profile.get("emulated_slowdown", 1.0)),
                   fits=fits, update_fit=lin(fits_in.get("update")), allreduce_fit=lin(fits_in.get("allreduce")),
                   shared_sum_fit=_shared_fit(fits_in.get("shared_sum")),
                   host_link=link(host), bridge_link=link(br),
                   profile=dict(profile), corun_factor=_corun(fits_in.get("corun")),
                   corun_relation=_corun_relation(fits_in.get("corun")) if corun_by_size else (),
                   corun_by_size=None if corun_by_size is None else bool(corun_by_size),
                   corun_update_factor=(_corun(fits_in["corun_update"]) if fits_in.get("corun_update") else 0.0),
                   dp_fits=dp_fits,
                   update_dp_fits={int(k): lin(v) for k, v in (fits_in.get("update_dp") or {}).items()},
                   update_tp_fits={int(k): lin(v) for k, v in (fits_in.get("update_tp") or {}).items() if v},
                   norm_mesh_fits={tuple(int(x) for x in m.split("x")): lin(v)
                                   for m, v in (fits_in.get("norm_mesh") or {}).items() if v},
                   action_overhead_s=max(0.0, float((fits_in.get("runtime") or {}).get("per_action_s", 0.0))),
                   local_bridge_link=_local_bridge(fits_in.get("bridge_local")),
                   bridge_allreduce_fit=lin(fits_in.get("bridge_allreduce")),
                   cold_extra=_cold(fits_in.get("cold")), profile_path=path, norm_fit=lin(fits_in.get("norm")),
                   update_cold_per_param_s=max(0.0, float((fits_in.get("update_cold") or {}).get("per_param_s", 0.0))),
                   update_runtime_scale=_update_runtime_scale(fits_in, profile.get("samples") or (),
                                                              float(profile.get("emulated_slowdown", 1.0))),
                   action_costs=_action_costs(fits_in.get("actions")),
                   emulated_wait_fit=lin(fits_in.get("emulated_wait")),
                   stage_shapes=_stage_shapes(profile.get("samples") or ()),
                   serial_launch=bool((fits_in.get("launch") or {}).get("serial", False)),
                   shared_sum_mesh={tuple(int(x) for x in m.split("x")): float(v["factor"])
                                    for m, v in (fits_in.get("shared_sum_mesh") or {}).items() if v},
                   token_parts=_token_parts(profile.get("samples") or ()),
                   in_flight=_in_flight(fits_in.get("in_flight")))

    # ---- DP meshes ---------------------------------------------------------------------------------
    def measured_dp_degrees(self, tp: int) -> Tuple[int, ...]:
        """DP degrees whose ``(dp, tp)`` stage mesh has MEASURED figures in the profile, ascending: 1
        when the TP degree ``tp`` itself was profiled, and every ``dp`` of a profiled ``(dp, tp)`` mesh
        (``dp_fits``); () for the catalog. The planner weighs these against each other (on fake CPU
        devices sharing a host, DP 2 is not twice as fast as DP 1, and may be slower)."""
        if self.source != "profile":
            return ()
        out = {1} if int(tp) in self.fits else set()
        out |= {d for d, t in self.dp_fits if t == int(tp)}
        return tuple(sorted(out))

    def mesh_source(self, dp: int, tp: int) -> str:
        """Where the compute figures of a ``(dp, tp)`` stage mesh come from, in words: the catalog, the
        profile's measured mesh, or the profile's nearest TP degree scaled (tokens per DP rank, slope
        x profiled tp / tp: as if perfectly parallel, which devices sharing a host do not reach)."""
        if self.source != "profile":
            return f"catalog {self.name!r} x efficiency {self.efficiency:g}"
        dp, tp = int(dp), int(tp)
        if dp > 1 and (dp, tp) in self.dp_fits:
            return f"profile, mesh {dp}x{tp} measured"
        if dp == 1 and tp in self.fits:
            return f"profile, mesh 1x{tp} measured"
        lower = [t for t in sorted(self.fits) if t <= tp]
        t = lower[-1] if lower else min(self.fits)
        return (f"profile, mesh {dp}x{tp} NOT profiled: mesh 1x{t} scaled as if perfectly parallel "
                f"(tokens per DP rank{', slope x %d/%d' % (t, tp) if t != tp else ''})")

    # ---- compute -----------------------------------------------------------------------------------
    def _fit(self, tp: int, phase: str, part: str, dp: int = 1) -> Tuple[_Linear, float]:
        """The fitted line of the profiled ``(dp, tp)`` mesh when there is one (``dp > 1``), else of
        the nearest profiled TP degree <= tp (else the smallest), and the factor (profiled tp / tp)
        that scales its slope to ``tp`` shards."""
        _check_phase(phase)
        if dp > 1 and (dp, tp) in self.dp_fits:
            try:
                return self.dp_fits[(dp, tp)][phase][part], 1.0
            except KeyError:
                raise ValueError(f"profile {self.name!r} has no fit for mesh {dp}x{tp}, phase {phase!r}, "
                                 f"part {part!r}") from None
        tps = sorted(self.fits)
        lower = [t for t in tps if t <= tp]
        t = lower[-1] if lower else tps[0]
        try:
            return self.fits[t][phase][part], t / tp
        except KeyError:
            raise ValueError(f"profile {self.name!r} has no fit for tp={t}, phase {phase!r}, part {part!r}") from None

    def _compute(self, flops: float, tp: int, phase: str) -> float:
        return flops * _PHASE_FORWARDS[phase] / (tp * self.spec.peak_flops * self.efficiency)

    def layer_time_s(self, cfg: Any, tokens: float, seq_len: int, tp: int, phase: str, dp: int = 1) -> float:
        """Seconds of ONE decoder layer on a TP group of ``tp`` devices for ``tokens`` tokens (per DP
        rank of the stage) in sequences of ``seq_len``, phase in :data:`PHASES`.

        Catalog: forward FLOPs (:func:`analytic.layer_flops`) x the phase's forwards / (tp x peak x
        efficiency) + the phase's Megatron TP all-reduces of ``T x D`` activations (tp > 1).
        Profile: the fitted ``c0 + c1 x FLOPs`` of the profiled ``(dp, tp)`` mesh (``dp > 1``, when
        profiled) or of the nearest profiled TP degree.

        Raises:
          ValueError: for an unknown phase, or tp < 1.
        """
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        flops = analytic.layer_flops(cfg, tokens, seq_len)
        if self.source == "catalog":
            _check_phase(phase)
            t = self._compute(flops, tp, phase)
            if tp > 1:
                nbytes = tokens * cfg.hidden_size * analytic.dtype_bytes(cfg.dtype)
                t += _PHASE_TP_ALLREDUCES[phase] * self.allreduce_time_s(nbytes, tp)
            return t
        measured = self._token_part(tp, phase, "layer", dp, tokens)
        if measured is not None:
            return max(0.0, measured)
        fit, scale = self._fit(tp, phase, "layer", dp)
        return max(0.0, fit.c0 + fit.c1 * flops * scale)

    def embed_time_s(self, cfg: Any, tokens: float, tp: int, phase: str, dp: int = 1) -> float:
        """Seconds of the token embedding (a gather; backward a scatter-add into the embedding
        gradient) for ``tokens`` tokens. Catalog: ``T D`` elements read and written at ``efficiency x
        memory_bandwidth`` (x the phase's forwards)."""
        if self.source == "catalog":
            _check_phase(phase)
            nbytes = 2 * tokens * cfg.hidden_size * analytic.dtype_bytes(cfg.dtype)
            return nbytes * _PHASE_FORWARDS[phase] / (self.spec.memory_bandwidth * self.efficiency)
        measured = self._token_part(tp, phase, "embed", dp, tokens)
        if measured is not None:
            return max(0.0, measured)
        fit, scale = self._fit(tp, phase, "embed", dp)
        return max(0.0, fit.c0 + fit.c1 * tokens * scale)

    def head_time_s(self, cfg: Any, tokens: float, seq_len: int, tp: int, phase: str, dp: int = 1) -> float:
        """Seconds of the final norm, LM head and summed cross-entropy for ``tokens`` tokens."""
        flops = analytic.head_flops(cfg, tokens)
        if self.source == "catalog":
            _check_phase(phase)
            return self._compute(flops, tp, phase)
        measured = self._token_part(tp, phase, "head", dp, tokens)
        if measured is not None:
            return max(0.0, measured)
        fit, scale = self._fit(tp, phase, "head", dp)
        return max(0.0, fit.c0 + fit.c1 * flops * scale)

    def stage_overhead_s(self, tp: int, phase: str, dp: int = 1, tokens: Optional[float] = None) -> float:
        """Fixed seconds of one stage call (dispatch, argument handling, synchronisation), measured
        as the intercept of the profile's stage fits (with ``tokens`` on a profiled mesh between two
        profiled token counts: the measured part there, :meth:`_token_part`); 0 for catalog costs (an
        assumption: negligible against the compute of a large model)."""
        if self.source == "catalog":
            _check_phase(phase)
            return 0.0
        measured = self._token_part(tp, phase, "base", dp, tokens)
        if measured is not None:
            return max(0.0, measured)
        fit, _ = self._fit(tp, phase, "base", dp)
        return max(0.0, fit.c0)

    # ---- update and collectives ------------------------------------------------------------------
    def update_time_s(self, num_params_per_device: float, param_dtype_bytes: int = 4, dp: int = 1,
                      tp: int = 1) -> float:
        """Seconds of one AdamW update of ``num_params_per_device`` parameters on one device, as the
        runtime runs it (after the step's pipeline and gradient sums).

        Catalog: memory-bound; reads parameter, gradient and two moments and writes parameter and
        two moments, 7 x ``param_dtype_bytes`` per parameter (optax.adamw keeps its moments in the
        parameter dtype), at ``efficiency x memory_bandwidth``. Profile: fitted ``c0 + c1 x n`` (the
        update timed back to back); for a stage mesh with ``dp > 1`` the profiled mesh's update fit
        when there is one (on CPU every replica's update runs on the same cores), for a ``(1, tp)``
        mesh with ``tp > 1`` the profiled ``(1, tp)`` mesh's fit (:attr:`update_tp_fits`) when there is
        one; plus the measured :attr:`update_cold_per_param_s` x n (what the update costs more right
        after a pipeline). The one-device fit is scaled by :attr:`update_runtime_scale` (the runtime's own
        update call against the fit's stage kinds, measured in the same profile; session 14).
        """
        if self.source == "catalog":
            return 7.0 * param_dtype_bytes * num_params_per_device / (self.spec.memory_bandwidth * self.efficiency)
        cold = self.update_cold_per_param_s * max(0.0, float(num_params_per_device))
        if dp > 1 and self.update_dp_fits.get(dp) is not None:
            return self.update_dp_fits[dp](num_params_per_device) + cold
        if dp == 1 and tp > 1 and self.update_tp_fits.get(tp) is not None:
            return self.update_tp_fits[tp](num_params_per_device) + cold
        if self.update_fit is None:
            raise ValueError(f"profile {self.name!r} has no optimizer-update fit")
        return self.update_fit(num_params_per_device) * self.update_runtime_scale + cold

    def norm_time_s(self, counted_params: float, param_dtype_bytes: int = 4, dp: int = 1, tp: int = 1) -> float:
        """Seconds of one stage's part of the global gradient norm (runtime ``_forward_backward``: the
        jitted ``sq_norm`` of the ``counted_params`` gradient elements the stage counts, and the read
        of its scalar); 0 for none. Profile, a ``(dp, tp)`` mesh other than ``(1, 1)`` with a measured
        :attr:`norm_mesh_fits` line: that line (timed back to back on the mesh; on fake CPU devices a
        mesh's sq_norm is not 1/(dp tp) of one device's); profile with :attr:`norm_fit`: that measured
        line (one device, in the runtime's step). Otherwise derived: one read of the gradients against
        the update's seven accesses per parameter (see :meth:`update_time_s`), ``update_time_s / 7``."""
        if counted_params <= 0:
            return 0.0
        if self.source == "profile" and (dp, tp) != (1, 1) and self.norm_mesh_fits.get((dp, tp)) is not None:
            return max(0.0, self.norm_mesh_fits[(dp, tp)](counted_params))  # the measured mesh
        if self.source == "profile" and self.norm_fit is not None:
            return self.norm_fit(counted_params)
        return self.update_time_s(counted_params, param_dtype_bytes, dp, tp) / 7

    def allreduce_time_s(self, nbytes: float, num_devices: int) -> float:
        """Seconds of an all-reduce of ``nbytes`` (per device) over ``num_devices`` devices of one island.

        Catalog: ring all-reduce, ``2 (n - 1) alpha + 2 (n - 1) / n x nbytes / bandwidth`` (Patarasuk &
        Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations", section 3),
        with the intra-node link inside ``devices_per_node`` devices, else the network link. Profile:
        fitted ``c0 + c1 x nbytes x 2 (n - 1) / n``. 0 for one device.
        """
        n = int(num_devices)
        if n <= 1 or nbytes <= 0:
            return 0.0
        ring = 2.0 * (n - 1) / n
        if self.source == "catalog":
            intra = n <= self.spec.devices_per_node
            alpha, bw = (5e-6, self.spec.intra_node_bandwidth) if intra else (10e-6, self.spec.network_bandwidth)
            return 2 * (n - 1) * alpha + ring * nbytes / bw
        if self.allreduce_fit is None:
            raise ValueError(f"profile {self.name!r} has no all-reduce fit")
        return self.allreduce_fit(ring * nbytes)

    def shared_sum_s(self, nbytes: float, tensors: int = 1, dp: int = 1, tp: int = 1) -> float:
        """Seconds of the runtime's sum of gradients held by several stages of one process
        (``PipelineRuntime._reduce_shared``: each holder's float32 copy to the host, the sum, the copy
        back); ``nbytes`` and ``tensors``: float32 bytes and tensors summed over the holders, which are
        on ``(dp, tp)`` meshes. Profile: ``c_bytes x nbytes + c_tensor x tensors``, times the measured
        :attr:`shared_sum_mesh` ratio of the mesh when it was profiled; otherwise a copy each way,
        ``2 x host_copy_s``. 0 for ``nbytes <= 0``."""
        if nbytes <= 0:
            return 0.0
        if self.shared_sum_fit is not None:
            one = self.shared_sum_fit[0] * nbytes + self.shared_sum_fit[1] * tensors
            return one * self.shared_sum_mesh.get((int(dp), int(tp)), 1.0)
        return 2.0 * self.host_copy_s(nbytes)

    def host_copy_s(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` between a device and host memory (one direction)."""
        if self.host_link is None:
            return 0.0
        return self.host_link.time_s(nbytes)

    def source_text(self, path: Optional[str] = None) -> str:
        """Where these costs come from, in the words every command prints (``plan`` per group, ``train``
        per profile): :func:`cost_source_text` of this device type; ``path``: the profile file read."""
        if self.source == "catalog":
            return cost_source_text(self.name, efficiency=self.efficiency)
        p = self.profile or {}
        return cost_source_text(self.name, profile_path=path or self.profile_path, measured=p.get("date"))

    def describe(self) -> str:
        """One line naming the device type and where the figures come from."""
        if self.source == "catalog":
            return f"{self.name}: catalog figures x efficiency {self.efficiency:g} ({self.spec.source[:60]}...)"
        p = self.profile or {}
        return (f"{self.name}: profile of {p.get('date', '?')} on {p.get('machine', {}).get('node', '?')} "
                f"(JAX {p.get('jax_version', '?')}, emulated slowdown {self.emulated_slowdown:g})")


def cost_source_text(device: str, *, efficiency: Optional[float] = 0.4, profile_path: Optional[str] = None,
                     measured: Optional[str] = None, profiled: bool = False) -> str:
    """The one wording of where a group's costs come from (``plan`` and ``train --cluster`` print it):

    - measured (``profiled`` or a ``profile_path`` / ``measured`` date given):
      ``"profile <path> (measured <date>)"``;
    - else ``"catalog 'a100' datasheet peak x 0.4 efficiency (assumption, not measured; profile with
      python -m hethub_jax.profile)"``."""
    if profiled or profile_path or measured:
        return (f"profile {profile_path or '(given)'}"
                + (f" (measured {measured})" if measured else " (measured)"))
    return (f"catalog {device!r} datasheet peak x {efficiency:g} efficiency (assumption, not measured; "
            f"profile with python -m hethub_jax.profile)")


#: the file beside the island profiles (``<profiles dir>/bridge_allreduce.json``) holding the bridge's all-reduce
#: line MEASURED on the ranks of a plan-less training job (``train_predict``: ``profile.measure_bridge_allreduce``
#: and ``profile.fit_bridge_allreduce`` on the job's own ``MPI.COMM_WORLD``, between its islands' processes);
#: ``planner.search.group_costs`` (the plan CLI's ``--profiles``) and ``train_predict.cluster_costs`` give it to
#: every group's costs (:meth:`DeviceCosts.with_bridge_allreduce`), in place of a profile's own
#: ``fits.bridge_allreduce``
BRIDGE_ALLREDUCE_FILE = "bridge_allreduce.json"
BRIDGE_ALLREDUCE_FORMAT = "hethub-jax-bridge-allreduce/1"


def read_bridge_allreduce(profiles_dir: Optional[str]) -> Optional[Dict[str, Any]]:
    """The saved bridge all-reduce measurement of :data:`BRIDGE_ALLREDUCE_FILE` in ``profiles_dir``: a dict with
    ``format``, ``fit`` (``{"c0": s, "c1": s/byte, ...}``, ``profile.fit_bridge_allreduce``), ``samples``,
    ``date``, ``ranks``, ``hosts``; None when ``profiles_dir`` is None or has no such file.

    Raises:
      ValueError: the file is not such a measurement (format, or a fit without finite ``c0`` and ``c1 >= 0``),
        naming the file.
      OSError: the file exists but cannot be read.
    """
    if not profiles_dir:
        return None
    path = os.path.join(profiles_dir, BRIDGE_ALLREDUCE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        try:
            d = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e}); delete it to measure the bridge all-reduce again") from None
    fit = d.get("fit") if isinstance(d, Mapping) else None
    ok = (isinstance(d, Mapping) and d.get("format") == BRIDGE_ALLREDUCE_FORMAT and isinstance(fit, Mapping)
          and all(isinstance(fit.get(k), (int, float)) and math.isfinite(fit[k]) for k in ("c0", "c1"))
          and fit["c1"] >= 0)
    if not ok:
        raise ValueError(f"{path}: not a {BRIDGE_ALLREDUCE_FORMAT} file with a fit of finite c0 and c1 >= 0; "
                         f"delete it to measure the bridge all-reduce again")
    return dict(d, path=path)


def bridge_allreduce_text(fit: Mapping[str, Any]) -> str:
    """``"alpha 6.8e-05 s, beta 7.2e-10 s/byte"``: a bridge all-reduce line ``c0 + c1 x bytes`` in Hockney's
    terms (alpha the seconds of a call, beta the seconds per byte)."""
    return f"alpha {float(fit['c0']):.3g} s, beta {float(fit['c1']):.3g} s/byte"


def _local_bridge(d: Optional[Mapping[str, Any]]) -> Optional[LinkModel]:
    """``LinkModel(c0 / 2, 1 / c1)`` of a measured 2-thread all-reduce line (None when absent)."""
    if not d:
        return None
    return LinkModel(max(0.0, float(d["c0"])) / 2, 1.0 / max(float(d["c1"]), 1e-15))


def _corun(d: Optional[Mapping[str, Any]]) -> float:
    """The profile's measured co-run factor (>= 1; 1.0 when absent)."""
    return 1.0 if not d else max(1.0, float(d["factor"]))


def _corun_relation(d: Optional[Mapping[str, Any]]) -> Tuple[Tuple[float, float], ...]:
    """The profile's measured ``fits.corun.relation`` as ``((size_ratio, extra >= 0), ...)`` sorted by
    ratio (empty when absent or from a profile made before it was measured)."""
    pts = [(float(r), max(0.0, float(e))) for r, e in ((d or {}).get("relation") or []) if float(r) > 0]
    return tuple(sorted(pts))


def _cold(d: Optional[Mapping[str, Any]]) -> Dict[str, Dict[str, float]]:
    """The profile's measured cold-call extra seconds ``{position: {phase: seconds}}`` (empty when absent)."""
    if not d:
        return {}
    return {pos: {ph: float(r) for ph, r in phases.items() if ph in PHASES}
            for pos, phases in d.items() if pos in ("first", "middle", "last") and isinstance(phases, Mapping)}


def _action_costs(d: Optional[Mapping[str, Any]]) -> Dict[str, float]:
    """The profile's measured ``{"send_s", "recv_s", "fused_b_s", "gap_s"}`` (empty when absent)."""
    if not d:
        return {}
    return {k: max(0.0, float(d[k])) for k in ("send_s", "recv_s", "fused_b_s", "gap_s") if k in d}


def _in_flight(d: Optional[Mapping[str, Any]]) -> Dict[str, Dict[str, Tuple[Tuple[int, float], ...]]]:
    """The profile's measured ``fits.in_flight.factors`` as ``{position: {phase: ((count, factor), ...)}}``,
    counts ascending, factors > 0 (empty when absent: profiles made before session 13)."""
    out: Dict[str, Dict[str, Tuple[Tuple[int, float], ...]]] = {}
    for pos, phases in ((d or {}).get("factors") or {}).items():
        if pos not in ("first", "middle", "last") or not isinstance(phases, Mapping):
            continue
        for ph, pts in phases.items():
            pts = sorted((int(n), float(f)) for n, f in pts if int(n) >= 1 and float(f) > 0)
            if ph in PHASES and pts:
                out.setdefault(pos, {})[ph] = tuple(pts)
    return out


def _stage_shapes(samples: Any) -> Dict[Tuple[int, bool, bool, int, int, str], Tuple[Tuple[float, float], ...]]:
    """``DeviceCosts.stage_shapes`` from a profile's ``"stage_shape"`` samples: per shape, mesh and
    phase, ``(tokens, seconds)`` ascending (repeated token counts: their mean)."""
    acc: Dict[tuple, Dict[float, list]] = {}
    for s in samples:
        if not isinstance(s, Mapping) or s.get("kind") != "stage_shape":
            continue
        key = (int(s["layers"]), bool(s["is_first"]), bool(s["is_last"]), int(s.get("dp", 1)), int(s.get("tp", 1)),
               str(s["phase"]))
        acc.setdefault(key, {}).setdefault(float(s["tokens"]), []).append(float(s["seconds"]))
    return {k: tuple((t, sum(v) / len(v)) for t, v in sorted(pts.items())) for k, pts in acc.items()}


#: the parts ``(base, layers, embedding, LM head + loss)`` of each profiled stage kind (``_token_parts``)
_STAGE_KIND_PARTS = {"first": (1, 1, 1, 0), "mid1": (1, 1, 0, 0), "mid2": (1, 2, 0, 0), "last": (1, 1, 0, 1)}


def _token_parts(samples: Any, with_shapes: bool = False
                 ) -> Dict[Tuple[int, int, str], Tuple[Tuple[float, float, float, float, float], ...]]:
    """``DeviceCosts.token_parts`` from a profile's ``"stage"`` samples (``hethub_jax.profile.profile_compute``:
    stage kinds ``first`` (layer 0 and the embedding), ``mid1`` (one layer), ``mid2`` (two layers) and
    ``last`` (the last layer, LM head and loss)): per ``(dp, tp, phase)`` and token count at which all four
    were measured, the parts that reproduce them exactly: ``layer = max(0, mid2 - mid1)``, ``base = mid1 -
    layer``, ``embed = first - mid1``, ``head = last - mid1`` (a stage of ``n`` layers then costs ``base + n
    layer (+ embed) (+ head)``, as the fitted lines say). A layer measured below 0 s (noise) reads 0 so that
    stage seconds never fall with layers. Repeated samples: their mean.

    ``with_shapes``: where the profile also MEASURED whole stages at that mesh, phase and token count
    (``"stage_shape"`` samples, ``--stage-shapes``), the four parts are the least-squares solution
    (``numpy.linalg.lstsq``) over the four kinds and those shapes (each an equation ``base + n layer (+ embed)
    (+ head)``), the layer then held at no less than 0 s and the base refitted. Why (session 20,
    docs/benchmarks.md issue 13): ``mid2 - mid1`` is the difference of two ~1-2 ms calls and scattered
    0.5-5.9 ms per layer in pinned profiles, while the whole 6-layer model implied -0.8 to 3.4 ms: a 3-layer
    stage built from it was PREDICTED up to 37% above its measured calls. Not the default (offline it took one
    pinned run's MAPE from 8.3% to 5.9% and the other's from 9.6% to 11.7%): an in-run comparison of
    ``benchmarks/predictor_accuracy.py`` (``parts_with_shapes``)."""
    import numpy as np
    acc: Dict[tuple, Dict[str, List[float]]] = {}
    shapes: Dict[tuple, List[Tuple[Tuple[int, int, int, int], float]]] = {}
    for s in samples:
        if not isinstance(s, Mapping):
            continue
        key = None if "phase" not in s or "tokens" not in s else (
            int(s.get("dp", 1)), int(s.get("tp", 1)), str(s["phase"]), float(s["tokens"]))
        if s.get("kind") == "stage" and s.get("stage") in _STAGE_KIND_PARTS and key is not None:
            acc.setdefault(key, {}).setdefault(str(s["stage"]), []).append(float(s["seconds"]))
        elif with_shapes and s.get("kind") == "stage_shape" and key is not None:
            shapes.setdefault(key, []).append(((1, int(s["layers"]), int(bool(s["is_first"])),
                                                int(bool(s["is_last"]))), float(s["seconds"])))
    out: Dict[Tuple[int, int, str], List[Tuple[float, float, float, float, float]]] = {}
    for (dp, tp, phase, tokens), kinds in sorted(acc.items()):
        if len(kinds) < 4:
            continue
        m = {k: sum(v) / len(v) for k, v in kinds.items()}
        layer = max(0.0, m["mid2"] - m["mid1"])
        parts = (m["mid1"] - layer, layer, m["first"] - m["mid1"], m["last"] - m["mid1"])
        extra = shapes.get((dp, tp, phase, tokens))
        if extra:
            rows = [(_STAGE_KIND_PARTS[k], v) for k, v in m.items()] + extra
            a = np.array([r for r, _ in rows], dtype=float)
            y = np.array([v for _, v in rows], dtype=float)
            base, layer, embed, head = np.linalg.lstsq(a, y, rcond=None)[0]
            if layer < 0:  # refit the other three with the layer held at 0 s
                base, embed, head = np.linalg.lstsq(a[:, [0, 2, 3]], y, rcond=None)[0]
                layer = 0.0
            parts = (float(base), float(layer), float(embed), float(head))
        out.setdefault((dp, tp, phase), []).append((tokens, *parts))
    return {k: tuple(v) for k, v in out.items()}


def _update_runtime_scale(fits_in: Mapping[str, Any], samples, emulated: float = 1.0) -> float:
    """``fits.update_runtime.scale`` when the profile has it, else the same from its ``update_in_step``
    samples (measured, times the profile's ``emulated`` slowdown as its ``update`` fit is) and ``update``
    fit (``profile.fit_update_runtime``), else 1.0."""
    got = fits_in.get("update_runtime")
    if got:
        return float(got["scale"])
    from hethub_jax.profile import fit_update_runtime
    got = fit_update_runtime([dict(s, warm_seconds=s["warm_seconds"] * emulated) for s in samples
                              if s.get("kind") == "update_in_step" and "warm_seconds" in s], fits_in.get("update"))
    return float(got["scale"]) if got else 1.0


def _shared_fit(d: Optional[Mapping[str, Any]]) -> Optional[Tuple[float, float]]:
    return None if d is None else (float(d["c_bytes"]), float(d["c_tensor"]))
