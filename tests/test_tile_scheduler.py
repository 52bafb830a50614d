"""cuda/kernels/tile_scheduler_fwd.cuh, the sm_90a forward's tile order: a C++ check on small shapes (every tile
exactly once, pairs heaviest first, unit counts above INT_MAX refused), built with the system C++ compiler;
skipped without one."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_scheduler_visits_every_tile_once(tmp_path):
    exe = tmp_path / "tile_scheduler_check"
    subprocess.run(["c++", "-std=c++17", "-O1", f"-I{ROOT / 'cuda'}",
                    str(ROOT / "tests" / "cpp" / "tile_scheduler_check.cc"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    result = subprocess.run([str(exe)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert result.stdout.startswith("ok ")
