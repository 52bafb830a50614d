"""cuda/mask.h, the mask policies every kernel shares: an exhaustive C++ check on small shapes (built with the
system C++ compiler; skipped without one)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_mask_ranges_agree_with_visible(tmp_path):
    exe = tmp_path / "mask_check"
    subprocess.run(["c++", "-std=c++17", "-O1", f"-I{ROOT / 'cuda'}", str(ROOT / "tests" / "cpp" / "mask_check.cc"),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    result = subprocess.run([str(exe)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert result.stdout.startswith("ok ")
