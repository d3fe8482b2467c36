"""Build of the optional C hot path of the MPI bridge (``hethub_jax/comm/_hotpath.c``).

Everything else about the package is in pyproject.toml. The extension compiles against the headers
and library of the ``mpich`` wheel (a build requirement, the same MPICH the package runs on). If
they are missing, or there is no C compiler, the package installs without it and
``hethub_jax.comm.mpi`` uses its pure-Python paths (``hethub_jax.comm.mpi.HOTPATH`` says which).
"""

import os
from importlib import metadata

from setuptools import Extension, setup


def _mpich_dirs():
    """(include dir, library dir) of the installed ``mpich`` wheel, or None."""
    try:
        files = metadata.distribution("mpich").files or []
    except metadata.PackageNotFoundError:
        return None
    found = {f.name: os.path.dirname(os.path.abspath(str(f.locate()))) for f in files
             if f.name in ("mpi.h", "libmpi.so")}
    if len(found) < 2:
        return None
    return found["mpi.h"], found["libmpi.so"]


dirs = _mpich_dirs()
ext_modules = []
if dirs is None:
    print("hethub-jax: mpich headers not found; building without the C hot path of the MPI bridge")
else:
    ext_modules.append(Extension(
        "hethub_jax.comm._hotpath", ["hethub_jax/comm/_hotpath.c"],
        include_dirs=[dirs[0]], library_dirs=[dirs[1]], libraries=["mpi"],
        extra_compile_args=["-O2"], optional=True))

setup(ext_modules=ext_modules)
