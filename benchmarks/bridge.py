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

    python benchmarks/bridge.py --boundary --json boundary.json   # re-launches itself: mpiexec -n 4

``--boundary`` (issue 15): the exchange of one stage boundary between two islands of 2 processes
(ranks 0-1 island a, 2-3 island b), each stage with DP 2 over its processes: every process of a
sends its half of the activation to the matching process of b (routes from
``hethub_jax.parallel.exchange``, as the runtime does), against the same total bytes sent by one
process per island (rank 0 -> rank 2, ranks 1 and 3 idle), interleaved in the same run. Time =
barrier to barrier (all four ranks) of one exchange; aggregate bandwidth = total bytes / time.
Figures: ``boundary_2proc_over_1proc_min_ge_1MiB`` (aggregate bandwidth ratio at the worst size),
and both aggregate bandwidths at the largest size.

    python benchmarks/bridge.py --allreduce --json allreduce.json   # re-launches itself: mpiexec -n 2

``--allreduce`` (issues 13/17, session 15): ``MPIHostBridge.allreduce`` (sum of float32 by default,
``--dtype``) at 64 KiB, 1 MiB, 8 MiB and 32 MiB (``--sizes``) on ``--ranks`` processes (default 2),
three ways interleaved in the same run, the order rotating per repetition: ``exchange`` (the bridge's
default up to ``exchange_max_ranks`` ranks: whole buffers exchanged, summed on the host in rank
order), ``iallreduce`` (the same bridge with ``exchange_max_ranks=0``: MPI ``Iallreduce`` polled
under the deadline, the path before session 15) and ``raw_Allreduce`` (mpi4py's blocking
``Allreduce`` into a preallocated buffer: no deadline, no header check, no new result array). Each
call starts after a barrier; per call the wall time (``perf_counter``) and this process's CPU time
(``process_time``) are taken on every rank; a row holds rank 0's medians and the medians of the
per-repetition ratios (``iallreduce / exchange``, ``raw / exchange``: same repetition, so drifting
load cancels). The host allocator is the runtime's for CPU islands (``steady_host_allocator``)
unless ``--allocator default``. Every result is checked bitwise against numpy's rank-ordered sum of
the inputs (each rank rebuilds them from their seeds). Figures: ``iallreduce_over_exchange_min``
and ``..._8MiB`` (> 1: the exchange is faster), ``raw_over_exchange_8MiB``.
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
from benchmarks.common import CHILD_ENV, bridge_world, mpi_rank_from_env, relaunch_under_mpiexec  # noqa: E402

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
ALLREDUCE_SIZES = [64 << 10, 1 << 20, 8 << 20, 32 << 20]  # bytes each stage exchanges (issue 13)


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
    ap.add_argument("--boundary", action="store_true",
                    help="measure one stage boundary with 2 processes per island against 1 (4 ranks)")
    ap.add_argument("--allreduce", action="store_true",
                    help="the bridge's all-reduce (exchange, Iallreduce) against raw MPI Allreduce")
    ap.add_argument("--ranks", type=int, default=2, help="--allreduce: number of processes")
    ap.add_argument("--dtype", default="float32", help="--allreduce: element dtype (numpy or ml_dtypes name)")
    ap.add_argument("--spin-s", type=float, default=0.05, help="--allreduce: the bridge's spin_s")
    ap.add_argument("--allocator", choices=("steady", "default"), default="steady",
                    help="--allreduce: host allocator (steady: as the runtime's CPU islands)")
    args = ap.parse_args()
    if args.allreduce and args.sizes is SIZES:
        args.sizes = ALLREDUCE_SIZES
    if os.environ.get(CHILD_ENV) is None and mpi_rank_from_env() is None:
        relaunch_under_mpiexec(__file__, sys.argv[1:],
                               n=4 if args.boundary else args.ranks if args.allreduce else 2)
    if args.boundary:
        return boundary(args)
    if args.allreduce:
        return allreduce(args)

    import numpy as np

    MPI, comm, rank, bridge = bridge_world(2, "the bridge ping-pong")
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


def _exchange(bridge, rank: int, parts: list, bufs: dict, rbufs: dict) -> float:
    """One boundary exchange (``parts``: (src rank, dst rank, start, stop) in bytes); seconds from a
    barrier before to a barrier after (the slowest rank's time)."""
    bridge.barrier()
    t0 = time.perf_counter()
    sends = [bridge.isend(bufs[(p, q)], q, 21) for p, q, _, _ in parts if p == rank]
    for p, q, _, _ in parts:
        if q == rank:
            bridge.recv(p, 21, out=rbufs[(p, q)])
    for h in sends:
        h.wait()
    bridge.barrier()
    return time.perf_counter() - t0


def boundary(args) -> None:
    """``--boundary``: see the module docstring."""
    import numpy as np

    from hethub_jax.parallel import exchange

    _, comm, rank, bridge = bridge_world(4, "--boundary")
    rows = []
    for size in [s for s in args.sizes if s % 2 == 0]:
        layouts = {}
        for name, src, dst in [("one", {0: (0, size)}, {2: (0, size)}),
                               ("two", {0: (0, size // 2), 1: (size // 2, size)},
                                {2: (0, size // 2), 3: (size // 2, size)})]:
            parts = exchange.routes(src, dst)
            data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            bufs = {(p, q): data[a:b] for p, q, a, b in parts}
            rbufs = {(p, q): np.empty(b - a, np.uint8) for p, q, a, b in parts}
            layouts[name] = (parts, bufs, rbufs)
            _exchange(bridge, rank, parts, bufs, rbufs)  # warm-up
        times = {"one": [], "two": []}
        for rep in range(args.reps):
            for name in (["one", "two"] if rep % 2 == 0 else ["two", "one"]):
                times[name].append(_exchange(bridge, rank, *layouts[name]))
        for name, (parts, _, rbufs) in layouts.items():  # the bytes arrived intact (same data on every rank)
            for p, q, a, b in parts:
                assert q != rank or np.array_equal(rbufs[(p, q)], data[a:b]), (name, p, q)
        t1, t2 = statistics.median(times["one"]), statistics.median(times["two"])
        rows.append({"bytes": size, "reps": args.reps, "one_proc_s": t1, "two_proc_s": t2,
                     "one_proc_Bps": size / t1, "two_proc_Bps": size / t2,
                     "ratio": statistics.median(a / b for a, b in zip(times["one"], times["two"]))})
    if rank == 0:
        ge = [r for r in rows if r["bytes"] >= 1 << 20] or rows
        figures = {"boundary_2proc_over_1proc_min_ge_1MiB": round(min(r["ratio"] for r in ge), 4),
                   "boundary_2proc_over_1proc_largest": round(rows[-1]["ratio"], 4),
                   "boundary_2proc_Bps_largest": rows[-1]["two_proc_Bps"],
                   "boundary_1proc_Bps_largest": rows[-1]["one_proc_Bps"],
                   "largest_bytes": rows[-1]["bytes"]}
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "rows": rows, "cpus": os.cpu_count(),
                       "command": "python benchmarks/bridge.py " + " ".join(sys.argv[1:])}, f, indent=2)
        print(f"{'bytes':>10} {'1 proc GB/s':>11} {'2 proc GB/s':>11} {'ratio':>6}")
        for r in rows:
            print(f"{r['bytes']:>10} {r['one_proc_Bps'] / 1e9:>11.3f} {r['two_proc_Bps'] / 1e9:>11.3f} "
                  f"{r['ratio']:>6.3f}")
        print(json.dumps(figures, indent=2))
    comm.Barrier()


def allreduce(args) -> None:
    """``--allreduce``: see the module docstring."""
    import numpy as np

    from hethub_jax.comm.base import dtype_from_name, reduce_arrays
    from hethub_jax.comm.mpi import MPIHostBridge
    from hethub_jax.host_allocator import steady_host_allocator

    alloc = steady_host_allocator(args.allocator == "steady")["allocator"]
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    raw = comm.Dup()
    new = MPIHostBridge(comm.Dup(), timeout=120, spin_s=args.spin_s, exchange_max_ranks=max(n, 2))
    old = MPIHostBridge(comm.Dup(), timeout=120, spin_s=args.spin_s, exchange_max_ranks=0)
    dtype = dtype_from_name(args.dtype)

    def inputs(size: int) -> list:
        """Every rank's input, rebuilt from its seed (values in [-1, 1): sums round)."""
        k = max(size // dtype.itemsize, 1)
        return [np.random.default_rng(1000 * size + r).uniform(-1, 1, k).astype(dtype) for r in range(n)]

    rows = []
    for size in args.sizes:
        xs = inputs(size)
        x = xs[rank]
        want = reduce_arrays(xs, "sum")
        del xs
        out = np.empty(x.shape, np.float32 if dtype.itemsize < 4 else dtype)
        xr = x.astype(out.dtype)

        def raw_allreduce():
            raw.Allreduce(xr, out, op=MPI.SUM)

        ways = {"exchange": lambda: new.allreduce(x), "iallreduce": lambda: old.allreduce(x),
                "raw_Allreduce": raw_allreduce}
        for name in ("exchange", "iallreduce"):  # warm-up and the check: bitwise numpy's rank-ordered sum
            got = ways[name]()
            if name == "exchange":
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (size, name)
            else:  # MPI's order: equal in value to within rounding, not bitwise for 3+ ranks
                assert np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2, atol=1e-2)
        raw_allreduce()
        wall = {k: [] for k in ways}
        cpu = {k: [] for k in ways}
        names = list(ways)
        for rep in range(args.reps):
            for name in names[rep % 3:] + names[:rep % 3]:
                comm.Barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                ways[name]()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        row = {"bytes": int(x.nbytes), "dtype": dtype.name, "reps": args.reps}
        for name in ways:
            row[f"{name}_s"] = statistics.median(wall[name])
            row[f"{name}_cpu_s"] = statistics.median(cpu[name])
        row["iallreduce_over_exchange"] = statistics.median(a / b for a, b in zip(wall["iallreduce"], wall["exchange"]))
        row["raw_over_exchange"] = statistics.median(a / b for a, b in zip(wall["raw_Allreduce"], wall["exchange"]))
        rows.append(row)
    per_rank = comm.gather(rows, root=0)
    if rank == 0:
        by = {r["bytes"]: r for r in rows}
        eight = by.get(8 << 20)
        figures = {"iallreduce_over_exchange_min": round(min(r["iallreduce_over_exchange"] for r in rows), 4),
                   "iallreduce_over_exchange_8MiB": eight and round(eight["iallreduce_over_exchange"], 4),
                   "raw_over_exchange_8MiB": eight and round(eight["raw_over_exchange"], 4),
                   "ranks": n, "dtype": dtype.name, "spin_s": args.spin_s, "allocator": alloc,
                   "loadavg": list(os.getloadavg())}
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "rows": rows, "rows_per_rank": per_rank, "cpus": os.cpu_count(),
                       "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                       "command": "python benchmarks/bridge.py " + " ".join(sys.argv[1:])}, f, indent=2)
        print(f"{n} ranks, {dtype.name}, spin_s {args.spin_s:g}, allocator {alloc}, load {os.getloadavg()[0]:.1f}; "
              "rank 0 medians, ms wall (CPU)")
        print(f"{'bytes':>10} {'exchange':>17} {'iallreduce':>17} {'raw Allreduce':>17} {'iall/exch':>9} {'raw/exch':>9}")
        for r in rows:
            print(f"{r['bytes']:>10} " + " ".join(f"{1e3 * r[k + '_s']:>7.3f} ({1e3 * r[k + '_cpu_s']:>7.3f})"
                                                for k in ("exchange", "iallreduce", "raw_Allreduce"))
                  + f" {r['iallreduce_over_exchange']:>9.2f} {r['raw_over_exchange']:>9.2f}")
        print(json.dumps(figures, indent=2))
    comm.Barrier()


if __name__ == "__main__":
    main()
