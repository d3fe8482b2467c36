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


def _fake_site(root, editable: bool):
    """A site-packages directory holding distribution ``fake-hethub`` (its package files unless editable)."""
    info = root / "fake_hethub-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-hethub\nVersion: 1.0\n")
    if not editable:
        (root / "hethub_jax" / "comm").mkdir(parents=True)
        (root / "hethub_jax" / "comm" / "__init__.py").write_text("")
    return root


def test_target_is_the_imported_package_and_a_shadowed_installed_copy(tmp_path, monkeypatch):
    """A non-editable install shadowed by the clone (started from its root, which also holds the
    egg-info of an in-tree build, first on sys.path): the module goes to the imported package AND the
    installed copy; an editable install's metadata (no package files) adds nothing."""
    import hethub_jax.comm
    assert bh.imported_dir() == __import__("pathlib").Path(hethub_jax.comm.__path__[0]).resolve()
    site = _fake_site(tmp_path / "site", editable=False)
    editable = _fake_site(tmp_path / "site2", editable=True)
    clone_root = tmp_path / "clone"
    clone = clone_root / "hethub_jax" / "comm"
    clone.mkdir(parents=True)
    (clone / "__init__.py").write_text("")
    egg = clone_root / "fake_hethub.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: fake-hethub\nVersion: 1.0\n")
    for d in (site, editable, clone_root):  # the clone ends up first
        monkeypatch.syspath_prepend(str(d))
    installed = (site / "hethub_jax" / "comm").resolve()
    assert bh.installed_dirs("fake-hethub") == [clone.resolve(), installed]
    assert bh.target_dirs(clone, bh.installed_dirs("fake-hethub")) == [clone, installed]
    assert bh.target_dirs(installed, [installed]) == [installed]  # running the installed copy itself
    assert bh.target_dirs(clone, []) == [clone]
    assert bh.installed_dirs("no-such-dist-hethub") == []


def test_build_writes_module_and_sidecar_into_every_target_and_says_where(tmp_path, monkeypatch, capsys):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    monkeypatch.setattr(bh, "mpi_of_mpi4py", lambda: {"library_version": "Fake MPI 9\nx", "libmpi": "/l/libmpi.so"})
    monkeypatch.setattr(bh, "compile_command", lambda info, out: [
        sys.executable, "-c", f"open({out!r}, 'wb').write(b'module bytes')"])
    monkeypatch.setattr(bh, "target_dirs", lambda: dirs)
    assert bh.main([]) == 0
    out = capsys.readouterr().out
    import json
    import sysconfig
    name = "_hotpath" + sysconfig.get_config_var("EXT_SUFFIX")
    for d in dirs:
        assert (d / name).read_bytes() == b"module bytes"
        assert json.loads((d / "_hotpath.json").read_text())["library_version"].startswith("Fake MPI 9")
        assert str(d / name) in out
    assert "also copied to" in out and "installed copy" in out
