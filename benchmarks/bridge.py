"""MPIHostBridge send/recv against raw mpi4py Send/Recv of the same host buffers.

    python benchmarks/bridge.py --json bridge.json        # re-launches itself: mpiexec -n 2

Ping-pong between 2 ranks for message sizes 4 KiB .. 64 MiB: one-way time = round trip / 2,
bandwidth = bytes / one-way time (bytes/s). Raw and bridge repetitions are interleaved in the same
run (the order rotates); bandwidths are medians over repetitions, ratios are medians of the
per-repetition ratios (bridge and raw measured back to back). The bridge receives into a
preallocated buffer (``out=``, like raw ``Recv``) and, separately, into fresh arrays ("fresh").
Separately (rank 0, after the MPI part) the cost of host->device (``jax.device_put`` +
``block_until_ready``) and device->host (``np.array``, a copy) copies on the default JAX device
(on a CPU device, ``device_put`` may alias the host buffer, so h2d figures are not copy costs).

JSON: {"figures": {"ratio_vs_raw_mpi_min_ge_1MiB": ..., ...}, "rows": [...], "copies": [...],
"machine": {...}, "command": ...}. The ratio is bridge bandwidth / raw bandwidth at the worst size
>= 1 MiB (goal >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from benchmarks.common import CHILD_ENV, mpi_rank_from_env, relaunch_under_mpiexec  # noqa: E402

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]




def pingpong(comm, rank, send, recv, iters):
    """Seconds per one-way message over ``iters`` round trips."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            send(1)
            recv(1)
        else:
            recv(0)
            send(0)
    return (time.perf_counter() - t0) / (2 * iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="output path")
    ap.add_argument("--reps", type=int, default=15, help="interleaved repetitions per size")
    ap.add_argument("--min-time", type=float, default=0.01, help="seconds per repetition (about)")
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=SIZES,
                    help="comma-separated message sizes in bytes (default 4 KiB .. 64 MiB)")
    args = ap.parse_args()
    if os.environ.get(CHILD_ENV) is None and mpi_rank_from_env() is None:
        relaunch_under_mpiexec(__file__, sys.argv[1:])

    import numpy as np
    from mpi4py import MPI

    sys.path.insert(0, ROOT)
    from hethub_jax.comm.mpi import MPIHostBridge

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        sys.exit("run with exactly 2 ranks")
    bridge = MPIHostBridge(comm.Dup(), timeout=120)
    rows = []
    for size in args.sizes:
        buf = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        rbuf = np.empty_like(buf)

        def raw_send(peer):
            comm.Send([buf, MPI.BYTE], peer, 11)

        def raw_recv(peer):
            comm.Recv([rbuf, MPI.BYTE], peer, 11)

        def br_send(peer):
            bridge.send(buf, peer, 12)

        def br_recv(peer):
            bridge.recv(peer, 12)

        def out_recv(peer):
            bridge.recv(peer, 12, out=rbuf)

        # warm-up, and iterations so that one repetition takes about --min-time
        t = pingpong(comm, rank, raw_send, raw_recv, 2)
        pingpong(comm, rank, br_send, br_recv, 2)
        pingpong(comm, rank, br_send, out_recv, 2)
        iters = int(comm.bcast(max(1, min(2000, args.min_time / (2 * t))), root=0))
        raw, br, bo = [], [], []
        for rep in range(args.reps):
            order = [(raw, raw_send, raw_recv), (bo, br_send, out_recv), (br, br_send, br_recv)]
            for out, s, r in order[rep % 3:] + order[:rep % 3]:
                out.append(pingpong(comm, rank, s, r, iters))
        got = bridge.sendrecv(buf, 1 - rank, 1 - rank, sendtag=13)
        assert np.array_equal(got, buf)
        t_raw, t_br, t_bo = statistics.median(raw), statistics.median(br), statistics.median(bo)
        # ratios of adjacent (same repetition) measurements, then the median: robust to the
        # machine's load drifting during the run
        rows.append({"bytes": size, "iters": iters, "reps": args.reps,
                     "raw_s": t_raw, "bridge_s": t_bo, "bridge_fresh_s": t_br,
                     "raw_Bps": size / t_raw, "bridge_Bps": size / t_bo,
                     "bridge_fresh_Bps": size / t_br,
                     "ratio": statistics.median(a / b for a, b in zip(raw, bo)),
                     "ratio_fresh": statistics.median(a / b for a, b in zip(raw, br))})
    copies = []
    if rank == 0:
        import jax

        dev = jax.devices()[0]
        for size in args.sizes:
            host = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            x = jax.device_put(host, dev).block_until_ready()
            h2d, d2h = [], []
            n = max(1, int(2e8 // size))
            for _ in range(args.reps):
                t0 = time.perf_counter()
                for _ in range(n):
                    jax.device_put(host, dev).block_until_ready()
                h2d.append((time.perf_counter() - t0) / n)
                t0 = time.perf_counter()
                for _ in range(n):
                    np.array(x)  # a real copy (np.asarray may alias a CPU buffer)
                d2h.append((time.perf_counter() - t0) / n)
            th, td = statistics.median(h2d), statistics.median(d2h)
            copies.append({"bytes": size, "h2d_s": th, "d2h_s": td,
                           "h2d_Bps": size / th, "d2h_Bps": size / td})
        ge = [r for r in rows if r["bytes"] >= 1 << 20]
        worst = min(ge, key=lambda r: r["ratio"])
        figures = {
            "ratio_vs_raw_mpi_min_ge_1MiB": round(worst["ratio"], 4),
            "ratio_worst_size_bytes": worst["bytes"],
            "ratio_vs_raw_mpi_min_all": round(min(r["ratio"] for r in rows), 4),
            "ratio_fresh_buffer_min_ge_1MiB": round(min(r["ratio_fresh"] for r in ge), 4),
            "bridge_Bps_64MiB": rows[-1]["bridge_Bps"],
            "raw_Bps_64MiB": rows[-1]["raw_Bps"],
            "bridge_latency_4KiB_s": rows[0]["bridge_s"],
            "raw_latency_4KiB_s": rows[0]["raw_s"],
            "jax_device": str(dev),
        }
        machine = {"host": socket.gethostname(), "cpus": os.cpu_count(),
                   "platform": platform.platform(), "python": platform.python_version(),
                   "numpy": np.__version__, "mpi4py": __import__("mpi4py").__version__,
                   "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                   "jax": jax.__version__}
        result = {"figures": figures, "rows": rows, "copies": copies, "machine": machine,
                  "command": "python benchmarks/bridge.py " + " ".join(sys.argv[1:])}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"{'bytes':>10} {'raw GB/s':>9} {'bridge GB/s':>11} {'ratio':>6} "
              f"{'fresh GB/s':>10} {'ratio':>6} {'h2d GB/s':>9} {'d2h GB/s':>9}")
        for r, c in zip(rows, copies):
            print(f"{r['bytes']:>10} {r['raw_Bps'] / 1e9:>9.3f} {r['bridge_Bps'] / 1e9:>11.3f} "
                  f"{r['ratio']:>6.3f} {r['bridge_fresh_Bps'] / 1e9:>10.3f} "
                  f"{r['ratio_fresh']:>6.3f} {c['h2d_Bps'] / 1e9:>9.3f} {c['d2h_Bps'] / 1e9:>9.3f}")
        print(json.dumps(figures, indent=2))
    comm.Barrier()


if __name__ == "__main__":
    main()
