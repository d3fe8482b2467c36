"""The MPI host bridge's all-reduce between two island processes, against one transfer (issue 13, diagnostic).

    PYTHONPATH=. mpiexec -n 2 python benchmarks/bridge_allreduce_probe.py allreduce      # session 15's table
    PYTHONPATH=. mpiexec -n 2 python benchmarks/bridge_allreduce_probe.py exchange       # all-reduce vs exchange + sum
    PYTHONPATH=. mpiexec -n 2 python benchmarks/bridge_allreduce_probe.py busy-sender    # a sender that computes

``allreduce``: ``MPIHostBridge.allreduce`` (one ``Iallreduce`` polled by ``_CollRequest.wait``, the waits sleeping:
spin 0, as ``benchmarks/predictor_accuracy.py``'s islands), a blocking ``MPI.Allreduce`` (mpi4py) and the bridge's
one-way time (ping-pong / 2) and raw mpi4py's, at 64 KiB, 1 MiB and 8,192,000 bytes (the tiny model's tied
embedding, which two pipeline islands sum every step in ``PipelineRuntime._reduce_shared``); both ranks enter after a
barrier; medians of 15 after 3. ``exchange``: the bridge's all-reduce of 8,192,000 bytes against an exchange of the
whole arrays over the same bridge (``isend`` + ``recv``, then a numpy sum in the same order on both ranks), two
alternated passes. ``busy-sender``: rank 1 sleeps 5 ms after a barrier, stamps, ``isend`` s N bytes and computes
for 0 or 20 ms before waiting on the send; rank 0 tests its ``irecv`` every 0.2 ms (as the runtime's
``_StepExecutor``) and stamps when it holds the message (one host clock; medians of 9): does a busy sender hold the
message back? Results: docs/benchmarks.md, issue 13, session 15 (a diagnostic on a shared machine: compare the
columns of one run, not runs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _median_s(w, call, reps: int = 18, skip: int = 3) -> float:
    """Median wall seconds of ``call()`` over ``reps`` calls after the first ``skip``, each entered by
    both ranks after a barrier."""
    ts = []
    for _ in range(reps):
        w.Barrier()
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[skip:])


def _allreduce(w, br, r):
    import numpy as np
    from mpi4py import MPI
    raw, res = w.Dup(), {}
    for n in (16384, 262144, 2048000):
        x = np.ones(n, np.float32)
        out = np.empty_like(x)

        def bridge_pingpong():
            if r == 0:
                br.send(x, 1)
                br.recv(1)
            else:
                br.send(br.recv(0), 0)

        def mpi_pingpong():
            if r == 0:
                raw.Send(x, 1)
                raw.Recv(out, 1)
            else:
                raw.Recv(out, 0)
                raw.Send(out, 0)
        calls = {"bridge_allreduce": lambda: br.allreduce(x),
                 "mpi_Allreduce": lambda: raw.Allreduce(x, out, op=MPI.SUM),
                 "bridge_oneway": bridge_pingpong, "mpi_oneway": mpi_pingpong}
        for name, call in calls.items():  # one-way: a round trip halved
            res[f"{4 * n:>9d} B {name}"] = _median_s(w, call) / (2 if "oneway" in name else 1)
    return res


def _exchange(w, br, r):
    import numpy as np
    x, res = np.ones(2048000, np.float32), {}

    def exchange_and_add():
        h = br.isend(x, 1 - r, 7)
        other = br.recv(1 - r, 7)
        h.wait()
        _ = x + other if r == 0 else other + x  # rank 0's part first on both ranks
    for p in (1, 2):
        res[f"pass {p} bridge_allreduce"] = _median_s(w, lambda: br.allreduce(x))
        res[f"pass {p} exchange_and_add"] = _median_s(w, exchange_and_add)
    return res


def _busy_sender(w, br, r):
    import numpy as np
    a, res = np.random.default_rng(0).standard_normal((300, 300)), {}

    def busy(s):
        t = time.perf_counter()
        while time.perf_counter() - t < s:
            a @ a
    for nbytes in (1024, 16384, 65536, 131072, 262144, 1048576):
        for b in (0.0, 0.02):
            late, buf = [], np.zeros(nbytes // 4, np.float32)
            for i in range(10):
                w.Barrier()
                if r == 1:
                    time.sleep(0.005)
                    t = time.perf_counter()
                    h = br.isend(buf, 0, 3)
                    busy(b)
                    h.wait()
                    w.send(t, 0, 4)
                else:
                    h = br.irecv(1, 3, out=np.empty_like(buf))
                    while not h.test():
                        time.sleep(0.0002)
                    t1 = time.perf_counter()
                    h.wait()
                    t = w.recv(source=1, tag=4)
                    if i:
                        late.append(t1 - t)
            if r == 0:
                res[f"{nbytes:>8d} B, sender busy {1e3 * b:.0f} ms after isend: held after"] = statistics.median(late)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("allreduce", "exchange", "busy-sender"))
    ap.add_argument("--spin-s", type=float, default=0.0, help="the bridge's polling before its waits sleep")
    args = ap.parse_args()
    from mpi4py import MPI

    from hethub_jax.comm.mpi import MPIHostBridge
    w = MPI.COMM_WORLD
    r = w.Get_rank()
    if w.Get_size() != 2:
        raise SystemExit("run under mpiexec -n 2")
    br = MPIHostBridge(w.Dup(), timeout=60).with_spin(args.spin_s)
    res = {"allreduce": _allreduce, "exchange": _exchange, "busy-sender": _busy_sender}[args.mode](w, br, r)
    both = w.gather(res, root=0)
    if r == 0:
        print(f"{args.mode}, spin {args.spin_s:g} s, load {os.getloadavg()[0]:.1f} (LOADED unless nothing else ran)")
        for k in both[0]:
            print(f"  {k}: " + "  ".join(f"rank {q} {1e3 * d[k]:.3f} ms" for q, d in enumerate(both) if k in d))


if __name__ == "__main__":
    main()
