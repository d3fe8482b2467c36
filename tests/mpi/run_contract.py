"""Run the contract checks (comm_checks.py) on MPIHostBridge: `mpiexec -n 4 python run_contract.py`.

Uses chunk_bytes = 1 MiB so large messages travel in several chunks. Prints one line per check and
rank: "RESULT <check> <rank> PASS" or "RESULT <check> <rank> FAIL <error>", also written to
$RESULTS_DIR/rank<R>.txt when that variable is set (stdout lines of ranks may interleave). Optional
arguments name the checks to run (default: all). Exits 0 even when checks fail.
"""
import math
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import comm_checks  # noqa: E402
from hethub_jax.comm.mpi import MPIHostBridge  # noqa: E402

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


def main():
    comm = MPIHostBridge(chunk_bytes=MiB, timeout=30)
    assert comm.size == comm_checks.SIZE, f"run with {comm_checks.SIZE} ranks"
    checks = dict(comm_checks.CHECKS, chunking_mpi=check_chunking)
    names = sys.argv[1:] or list(checks)
    out_dir = os.environ.get("RESULTS_DIR")
    log = open(os.path.join(out_dir, f"rank{comm.rank}.txt"), "w") if out_dir else None
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
