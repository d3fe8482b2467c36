"""Run the contract checks (comm_checks.py) on MPIHostBridge: `mpiexec -n 4 python run_contract.py`.

Uses chunk_bytes = 1 MiB so large messages travel in several chunks. First line per rank:
"RESULT hotpath <rank> ON|OFF" (whether the C hot path of the bridge is in use). Prints one line per check and
rank: "RESULT <check> <rank> PASS" or "RESULT <check> <rank> FAIL <error>", also written to
$RESULTS_DIR/rank<R>.txt when that variable is set (stdout lines of ranks may interleave). Optional
arguments name the checks to run (default: all). Exits 0 even when checks fail.
"""
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import comm_checks  # noqa: E402
from hethub_jax.comm.mpi import HOTPATH, MPIHostBridge  # noqa: E402

MiB = 1 << 20


def check_chunking(comm):
    """MPI only: a 3.3 MiB message really travels as ceil(nbytes / 1 MiB) payload messages."""
    n = 3 * MiB + 12345
    if comm.rank == 0:
        req = comm.isend(np.ones(n, np.uint8), 3, tag=20)
        assert len(req._reqs) == 1 + math.ceil(n / MiB), len(req._reqs)
        req.wait()
    elif comm.rank == 3:
        req = comm.irecv(0, tag=20)
        assert req.wait().sum() == n
        assert len(req._reqs) == math.ceil(n / MiB), len(req._reqs)
    comm.barrier()


def check_fast_path_timeouts(comm):
    """MPI only: a send and a recv(out=) on warmed channels (the fast paths, and the C hot path when
    built) time out with the peer and tag named; the timed-out send's buffer stays alive until
    the message is received later, and the channels keep working."""
    from hethub_jax.comm.base import CommTimeoutError

    a = np.arange(2 * MiB // 4, dtype=np.float32)  # above MPICH's eager limit: needs the receiver
    if comm.rank == 0:
        for k in range(3):
            comm.send(a + k, 1, tag=50)
        try:
            comm.send(a + 3, 1, tag=50, timeout=0.3)
        except CommTimeoutError as e:
            assert "rank 1" in str(e) and "tag 50" in str(e), str(e)
        else:
            raise AssertionError("send without a receiver did not time out")
        assert len(comm._abandoned) == 1
    elif comm.rank == 1:
        out = np.empty_like(a)
        for k in range(3):
            assert comm.recv(0, tag=50, out=out) is out and np.array_equal(out, a + k)
        try:
            comm.recv(2, tag=51, out=out, timeout=0.3)
        except CommTimeoutError as e:
            assert "rank 2" in str(e) and "tag 51" in str(e), str(e)
        else:
            raise AssertionError("recv(out=) without a sender did not time out")
    comm.barrier()
    if comm.rank == 1:  # the timed-out send, received late: its buffer was kept alive
        out = np.empty_like(a)
        assert comm.recv(0, tag=50, out=out) is out and np.array_equal(out, a + 3)
        assert comm.recv(2, tag=51, out=out[:4]) is not None and np.array_equal(out[:4], a[:4])
    elif comm.rank == 2:
        comm.send(a[:4], 1, tag=51)
    comm.barrier()
    deadline = time.monotonic() + 10  # the receiver has the message: the send completes
    while comm._abandoned and time.monotonic() < deadline:
        comm._reap()
    assert not comm._abandoned, "a completed send was not released"


def check_fast_paths_taken(comm):
    """MPI only: once a tag has carried a message, repeated sends of that dtype and shape and
    receives into out= of it take the fast paths (C hot path when built): no general-path send
    (``_isend_part``) and no general receive request (``_RecvRequest``) after the first two."""
    from hethub_jax.comm import mpi as mpi_mod

    calls = {"send": 0, "recv": 0}
    isend_part, recv_request = comm._isend_part, mpi_mod._RecvRequest

    def counting_isend_part(*args, **kw):
        calls["send"] += 1
        return isend_part(*args, **kw)

    class CountingRecvRequest(recv_request):
        def __init__(self, *args, **kw):
            calls["recv"] += 1
            super().__init__(*args, **kw)

    comm._isend_part, mpi_mod._RecvRequest = counting_isend_part, CountingRecvRequest
    try:
        a = np.arange(MiB // 4, dtype=np.float32).reshape(4, -1)  # one chunk, above the eager limit
        out = np.empty_like(a)
        if comm.rank in (1, 2):
            peer = 3 - comm.rank
            for k in range(12):
                if (comm.rank == 1) == (k % 2 == 0):
                    comm.send(a + k, peer, tag=70)
                else:
                    assert comm.recv(peer, tag=70, out=out) is out and np.array_equal(out, a + k)
            # one general send and one general receive on each rank: the first message each way
            assert calls == {"send": 1, "recv": 1}, calls
    finally:
        comm._isend_part, mpi_mod._RecvRequest = isend_part, recv_request
    comm.barrier()


def check_allreduce_rank_order_3(comm):
    """MPI only: three ranks with ``exchange_max_ranks=3`` (the exchange path; the default 2 would
    take MPI's Iallreduce): numpy's rank-ordered reduction, the same bits on every rank, every
    contract dtype; and the same four ranks with the default stay on Iallreduce."""
    assert comm.exchange_max_ranks == 2
    sub = comm.split(0 if comm.rank < 3 else None, key=comm.rank)
    if sub is not None:
        three = MPIHostBridge(sub.mpi_comm, chunk_bytes=MiB, timeout=30, exchange_max_ranks=3)
        comm_checks.assert_rank_order_allreduce(three, "3 ranks")
    comm.barrier()


def check_allreduce_exchange_timeout(comm):
    """MPI only: in a 2-rank exchange all-reduce, a peer that never arrives makes the other raise
    CommTimeoutError naming the all-reduce and the peer (no hang); the bridge's later collectives on
    its other communicators still work."""
    from hethub_jax.comm.base import CommTimeoutError

    sub = comm.split(comm.rank // 2, key=comm.rank)  # {0, 1} and {2, 3}; left behind afterwards
    if comm.rank in (0, 3):
        t0 = time.monotonic()
        try:
            sub.allreduce(np.ones(16, np.float32), timeout=0.3)  # 64 bytes: an eager send completes
        except CommTimeoutError as e:
            assert isinstance(e, TimeoutError)
            peer = 1 - sub.rank
            assert "allreduce(sum)" in str(e) and f"rank {peer}" in str(e), str(e)
        else:
            raise AssertionError("allreduce without its peer did not time out")
        assert time.monotonic() - t0 < 10, "the timeout took far longer than asked"
    comm.barrier()
    assert comm.allreduce(np.array([comm.rank], np.int64))[0] == sum(range(comm.size))


def main():
    comm = MPIHostBridge(chunk_bytes=MiB, timeout=30)
    assert comm.size == comm_checks.SIZE, f"run with {comm_checks.SIZE} ranks"
    checks = dict(comm_checks.CHECKS, chunking_mpi=check_chunking,
                  fast_path_timeouts_mpi=check_fast_path_timeouts,
                  fast_paths_taken_mpi=check_fast_paths_taken,
                  allreduce_rank_order_3_mpi=check_allreduce_rank_order_3,
                  allreduce_exchange_timeout_mpi=check_allreduce_exchange_timeout)
    names = sys.argv[1:] or list(checks)
    out_dir = os.environ.get("RESULTS_DIR")
    log = open(os.path.join(out_dir, f"rank{comm.rank}.txt"), "w") if out_dir else None
    line = f"RESULT hotpath {comm.rank} {'ON' if HOTPATH else 'OFF'}"  # C hot path in use?
    print(line, flush=True)
    if log:
        log.write(line + "\n")
    for name in names:
        try:
            checks[name](comm)
            line = f"RESULT {name} {comm.rank} PASS"
        except Exception as e:  # report and keep going so one failure does not hide the others
            tb = traceback.format_exc().replace("\n", " | ")
            msg = str(e).replace("\n", " | ")
            line = f"RESULT {name} {comm.rank} FAIL {type(e).__name__}: {msg} || {tb}"
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()
        try:
            comm.barrier(timeout=60)
        except Exception:
            print(f"RESULT {name} {comm.rank} FAIL barrier after the check timed out", flush=True)
            raise
    print(f"DONE {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
