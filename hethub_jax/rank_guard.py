"""Names a rank that dies without a word: ``mpiexec -n N python -m hethub_jax.rank_guard python -m hethub_jax.train ...``.

A rank killed by a signal (SIGKILL from the out-of-memory killer or a scheduler, a segmentation
fault) prints nothing, and the launcher's report does not reliably say which rank it was (MPICH
hydra's "BAD TERMINATION ... PID P" named a surviving rank's PID in our runs, because its clean-up
kills every other rank with the same signal). The guard runs the rank's command as its child (same
environment and inherited file descriptors, so the MPI process manager's connection is the
child's), waits for it, and when the child ended by a signal writes to stderr::

    [hethub rank_guard] rank R (pid P on HOST) was killed by signal SIGKILL

then exits with 128 + the signal number, so the launcher ends the job. Any other exit status is
passed through unchanged. SIGTERM and SIGINT sent to the guard are forwarded to the child.
The rank number is read from the launcher's environment (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``,
``PMIX_RANK``, ``SLURM_PROCID``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Mapping, Sequence

RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def launcher_rank(environ: Mapping[str, str] | None = None) -> str:
    """This process's MPI rank from the launcher's environment, ``"?"`` when none is set."""
    environ = os.environ if environ is None else environ
    for var in RANK_VARS:
        if environ.get(var, "").isdigit():
            return environ[var]
    return "?"


def run(cmd: Sequence[str], stream=None) -> int:
    """Runs ``cmd`` as a child and returns the guard's exit status (see the module docstring).

    Raises:
      ValueError: if ``cmd`` is empty.
    """
    if not cmd:
        raise ValueError("usage: python -m hethub_jax.rank_guard COMMAND [ARGS...]")
    child = subprocess.Popen(list(cmd), close_fds=False)  # the PMI connection fd must stay open
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    if code >= 0:
        return code
    name = signal.Signals(-code).name
    out = stream or sys.stderr
    out.write(f"[hethub rank_guard] rank {launcher_rank()} (pid {child.pid} on {socket.gethostname()}) "
              f"was killed by signal {name}\n")
    out.flush()
    return 128 - code


if __name__ == "__main__":
    try:
        sys.exit(run(sys.argv[1:]))
    except ValueError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
