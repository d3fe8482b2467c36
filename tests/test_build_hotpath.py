"""hethub_jax.comm.build_hotpath: the C hot path is compiled only against the MPI mpi4py runs on."""

import os
import subprocess
import sys

import pytest

from hethub_jax.comm import build_hotpath as bh


def test_compile_command_links_exactly_the_loaded_library():
    info = {"library_version": "Some MPI 1.0", "libmpi": "/opt/mpi/lib/libmpi.so.40",
            "include_dir": "/opt/mpi/include", "mpicc": "/usr/bin/mpicc"}
    cmd = bh.compile_command(info, "/tmp/out.so")
    assert "-I/opt/mpi/include" in cmd and "/opt/mpi/lib/libmpi.so.40" in cmd
    assert "-Wl,-rpath,/opt/mpi/lib" in cmd and "-lmpi" not in cmd  # no library search by name
    assert "/usr/bin/mpicc" not in cmd  # header + library of the loaded MPI win over a wrapper


def test_compile_command_uses_mpi4py_mpicc_for_a_source_build():
    info = {"library_version": "X", "libmpi": None, "include_dir": None, "mpicc": "/site/bin/mpicc"}
    assert bh.compile_command(info, "o.so")[0] == "/site/bin/mpicc"


def test_compile_command_refuses_without_header_or_wrapper():
    info = {"library_version": "Open MPI v5\nmore", "libmpi": "/x/libmpi.so.40", "include_dir": None,
            "mpicc": None}
    with pytest.raises(bh.BuildSkipped, match="no mpicc or mpi.h.*Open MPI v5.*libmpi.so.40"):
        bh.compile_command(info, "o.so")


def test_loaded_library_is_the_one_mpi4py_reports():
    """In a fresh process, after mpi4py started its MPI, the file found is a loaded libmpi; where the
    hot path is expected (HETHUB_EXPECT_HOTPATH=1, CI) its installation also has mpi.h or mpicc."""
    code = ("from mpi4py import MPI; from hethub_jax.comm import build_hotpath as bh; "
            "i = bh.mpi_of_mpi4py(); print(i['libmpi']); print(i['include_dir'] or i['mpicc'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lib, where = out.stdout.split("\n")[:2]
    assert os.path.basename(lib).startswith("libmpi") and os.path.exists(lib), out.stdout
    if os.environ.get("HETHUB_EXPECT_HOTPATH", "").strip() == "1":
        assert where != "None", out.stdout
