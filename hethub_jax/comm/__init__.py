"""Unified communicator: one contract (``base.Communicator``), several backends.

- ``LocalCommunicator`` (``comm.local``): logical ranks inside one process.
- ``MPIHostBridge`` (``comm.mpi``): host buffers over mpi4py between processes and islands.

``comm.mpi`` is imported on first use so that ``mpi4py`` is only needed by multi-process runs.
See docs/communicator.md.
"""

from .base import CommError, CommTimeoutError, Communicator, Header, Request
from .local import LocalCommunicator

__all__ = ["CommError", "CommTimeoutError", "Communicator", "Header", "Request",
           "LocalCommunicator", "MPIHostBridge"]


def __getattr__(name):
    if name == "MPIHostBridge":
        from .mpi import MPIHostBridge

        return MPIHostBridge
    raise AttributeError(name)
