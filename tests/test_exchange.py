"""Row routing between the processes of two stages (hethub_jax/parallel/exchange.py), checked
against a per-sample brute force: which process holds sample i on each side, from the device
layout alone."""

import itertools

import pytest

from hethub_jax.parallel import exchange


def _holder(sample: int, mbs: int, devices, dp: int, tp: int, dpp: int) -> int:
    """Brute force: the process holding `sample` (its DP row's first device // devices per process)."""
    row = sample // (mbs // dp)
    return devices[row * tp] // dpp


def _layouts(max_procs=3, max_dpp=2):
    """Every stage layout of up to `max_procs` processes: (dp, tp, dpp, devices) with the devices of
    the first processes in order (the plan's default assignment) or one device per process."""
    for dpp in range(1, max_dpp + 1):
        for procs in range(1, max_procs + 1):
            for tp in [t for t in range(1, dpp + 1) if dpp % t == 0]:
                for dp in range(1, procs * dpp // tp + 1):
                    yield dp, tp, dpp, list(range(dp * tp))
            if dpp > 1:  # one device of each process: devices 0, dpp, 2*dpp, ...
                yield procs, 1, dpp, [p * dpp for p in range(procs)]


@pytest.mark.parametrize("mbs", [4, 6, 12])
def test_routes_deliver_every_sample_once_to_its_holder(mbs):
    cases = [lay for lay in _layouts() if mbs % lay[0] == 0]
    assert len(cases) > 10
    for (sdp, stp, sdpp, sdev), (ddp, dtp, ddpp, ddev) in itertools.product(cases, cases):
        src = exchange.process_rows(mbs, exchange.row_processes(sdev, sdp, stp, sdpp))
        dst = exchange.process_rows(mbs, exchange.row_processes(ddev, ddp, dtp, ddpp))
        got = {}
        for p, q, lo, hi in exchange.routes(src, dst):
            assert src[p][0] <= lo < hi <= src[p][1] and dst[q][0] <= lo < hi <= dst[q][1]
            for i in range(lo, hi):
                assert i not in got, f"sample {i} routed twice"
                got[i] = (p, q)
        want = {i: (_holder(i, mbs, sdev, sdp, stp, sdpp), _holder(i, mbs, ddev, ddp, dtp, ddpp))
                for i in range(mbs)}
        assert got == want, ((sdp, stp, sdpp, sdev), (ddp, dtp, ddpp, ddev))
        pairs = [(p, q) for p, q, _, _ in exchange.routes(src, dst)]
        assert len(pairs) == len(set(pairs))  # one message per pair of processes


def test_process_rows_are_the_dp_rows_of_each_process():
    # dp 4 over 2 processes of 2 devices, tp 1: process 0 holds rows 0-1, process 1 rows 2-3
    assert exchange.process_rows(8, exchange.row_processes([0, 1, 2, 3], 4, 1, 2)) == {0: (0, 4), 1: (4, 8)}
    assert exchange.process_rows(4, [0]) == {0: (0, 4)}


def test_bad_layouts_name_the_constraint():
    with pytest.raises(ValueError, match="TP must fit inside one process"):
        exchange.row_processes([1, 2], 1, 2, 2)  # a TP row across processes 0 and 1
    with pytest.raises(ValueError, match="consecutive"):
        exchange.row_processes([0, 2, 1], 3, 1, 2)  # processes 0, 1, 0
    with pytest.raises(ValueError, match="divisible by the DP degree"):
        exchange.process_rows(3, [0, 1])
