"""Building and caching the CPU kernels: a private cache folder, or nothing loaded from it."""

import os
import shutil

import pytest

from hfaccel.kernels import cpu_build

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or not hasattr(os, "getuid"),
    reason="needs a C compiler and POSIX users",
)

_SOURCE = "int hfaccel_answer(void) { return 42; }\n"


def test_builds_into_a_private_folder_and_reuses_the_library(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(cpu_build.tempfile, "tempdir", None)  # re-read TMPDIR
    library = cpu_build.build_library("answer", _SOURCE, ["-O2"])
    assert library is not None and library.hfaccel_answer() == 42
    folder = tmp_path / f"hfaccel-kernels-{os.getuid()}"
    assert folder.stat().st_mode & 0o777 == 0o700
    (built,) = folder.glob("answer_*.so")
    before = built.stat().st_mtime_ns
    assert cpu_build.build_library("answer", _SOURCE, ["-O2"]).hfaccel_answer() == 42
    assert built.stat().st_mtime_ns == before  # loaded from the cache, not rebuilt


def test_refuses_a_cache_folder_others_can_write(tmp_path, monkeypatch, caplog):
    """A library in the cache folder is loaded into the process and its name is predictable: a folder
    that others can write to is not used at all (the torch paths run), and the user is told."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(cpu_build.tempfile, "tempdir", None)
    folder = tmp_path / f"hfaccel-kernels-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o777)
    with caplog.at_level("WARNING"):
        assert cpu_build.build_library("answer", _SOURCE, ["-O2"]) is None
    assert "only it can write" in caplog.text
    assert not list(folder.glob("*.so"))
