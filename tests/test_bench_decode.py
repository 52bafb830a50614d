"""benchmarks/bench_decode.py on the CPU: a smoke run writes its rows (with the fields the issue names) and table,
skips the GPU-only peers, and says it is a smoke run; bad arguments are clear errors."""
import json
import os
import pathlib
import subprocess
import sys

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
FIELDS = {"impl", "B", "Tq", "Sk", "Hq", "Hkv", "D", "paged", "page_size", "ragged", "us", "gbps", "kv_bytes",
          "pct_peak", "device", "jax_version"}


def _run(tmp_path, *extra):
    return subprocess.run([sys.executable, "-B", str(_PATH), "--calls", "1", "--reps", "1", "--out", str(tmp_path),
                           "--name", "run", *extra], cwd=tmp_path, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=600)


def test_smoke_run_writes_rows_and_table(tmp_path):
    result = _run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No GPU: a smoke run" in result.stdout
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {"jax_flash", "xla"}  # GPU-only peers do not apply
    for r in rows:
        assert FIELDS <= set(r) and r["error"] is None and r["us"] > 0 and r["gbps"] > 0
    # every (Tq, lengths, layout) of the smoke preset has a jax_flash row; xla only dense
    ours = {(r["Tq"], r["ragged"], r["page_size"]) for r in rows if r["impl"] == "jax_flash"}
    assert ours == {(t, g, p) for t in (1, 4) for g in (False, True) for p in (None, 16)}
    assert all(not r["paged"] for r in rows if r["impl"] == "xla")
    equal = [r for r in rows if not r["ragged"]]
    assert all(r["kv_bytes"] == 2 * 256 * 2 * 64 * 2 * 4 for r in equal)  # B S Hkv D, K and V, float32 on the CPU
    md = (tmp_path / "run.md").read_text()
    assert "Smoke run without a GPU" in md and "Targets not checked" in md


def test_unknown_layout_is_an_error(tmp_path):
    result = _run(tmp_path, "--layouts", "paged32")
    assert result.returncode != 0 and "--layouts: unknown ['paged32']" in result.stderr
