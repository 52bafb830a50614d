"""benchmarks/bench_attention.py on the CPU: a complete run writes its table and removes the partial file; a run
stopped after its first shape leaves that shape's rows in <stem>.partial.json, which --merge tabulates; the plot has
a panel only for the (head dim, causal) pairs with data; --head-dims matching no shape is an argument error; a run
without a GPU says it is a smoke run, shows its (small) rates and jax_flash/xla ratios, and by default writes
outside the source tree."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PATH = _ROOT / "benchmarks" / "bench_attention.py"


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("bench_attention", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ARGS = ["--impls", "jax_flash", "--shapes", "1x16x2x64,1x24x2x64c", "--warmup", "1", "--iters", "1",
        "--min-time", "0", "--ref-heads", "1"]


def test_complete_run_writes_results_and_removes_partial(bench, tmp_path):
    assert bench.main(ARGS + ["--out", str(tmp_path), "--name", "run"]) == 0
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert [(r["Sq"], r["causal"]) for r in rows] == [(16, False), (24, True)]
    assert all(r["error"] is None and r["fwd_ms"] > 0 for r in rows)
    assert (tmp_path / "run.md").exists()
    assert not (tmp_path / "run.partial.json").exists()


def test_stopped_run_keeps_finished_shapes(bench, tmp_path, monkeypatch):
    run_case = bench.run_case
    calls = []

    def stop_on_second_shape(shape, *args):
        calls.append(shape)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return run_case(shape, *args)

    monkeypatch.setattr(bench, "run_case", stop_on_second_shape)
    with pytest.raises(KeyboardInterrupt):
        bench.main(ARGS + ["--out", str(tmp_path), "--name", "run"])
    assert not (tmp_path / "run.json").exists()
    partial = json.loads((tmp_path / "run.partial.json").read_text())
    assert partial["meta"]["partial"] == "1 of 2 shapes"
    assert [(r["Sq"], r["causal"]) for r in partial["rows"]] == [(16, False)]
    assert bench.main(["--merge", str(tmp_path / "run.partial.json"), "--out", str(tmp_path), "--name", "merged"]) == 0
    assert "Partial run: 1 of 2 shapes." in (tmp_path / "merged.md").read_text()


def test_plot_panels_only_where_there_is_data(bench):
    def row(b, s, hq, hkv, d, causal, error=None):
        return dict(B=b, Sq=s, Hq=hq, Hkv=hkv, D=d, causal=causal, error=error)

    tokens = bench.TOKENS
    rows = [row(tokens // 4096, 4096, 16, 16, 128, False), row(tokens // 4096, 4096, 16, 16, 128, True),
            row(tokens // 4096, 4096, 8, 8, 256, False),
            row(tokens // 4096, 4096, 32, 8, 128, True),      # GQA: not plotted
            row(1, 1024, 16, 16, 64, False),                  # not the fixed token count: not plotted
            row(tokens // 512, 512, 8, 8, 256, True, "OOM")]  # failed: not plotted
    shown, panels = bench.plot_rows(rows)
    assert panels == [(128, False), (128, True), (256, False)]
    assert shown == rows[:3]


def test_head_dims_without_shapes_is_a_clear_error(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(ARGS + ["--head-dims", "512", "--out", str(tmp_path), "--name", "run"])
    assert "--head-dims 512: no shape" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_smoke_run_shows_rates_and_ratios(tmp_path):
    """A run without a GPU (JAX on the CPU, also on a machine that has one) says it is a smoke run."""
    args = ["--impls", "jax_flash,xla"] + ARGS[2:] + ["--out", str(tmp_path), "--name", "run"]
    result = subprocess.run([sys.executable, "-B", str(_PATH), *args], cwd=tmp_path,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    printed = result.stdout
    assert "No GPU: a smoke run" in printed and "not performance numbers" in printed
    assert " 0 TFLOP/s" not in printed
    md = (tmp_path / "run.md").read_text()
    assert "Smoke run without a GPU" in md and "ratio = jax_flash / xla" in md
    table = [line.split(" | ") for line in md.splitlines() if line.startswith("| 1, ")]
    assert len(table) == 2
    for cells in table:  # jax_flash, xla, fwd ratio, bwd ratio: one-iteration CPU timings are noise, so a ratio
        # may print as 0.00; it must be there and be a number
        assert not cells[1].startswith("0 /") and float(cells[3]) >= 0 and float(cells[4]) >= 0
    assert "Geometric mean jax_flash/xla" in md


def _tree(root):
    """{path: (size, mtime)} of every file under root but .git, bytecode caches and the git-ignored local folders
    prof/ and dist/ (other tests and tools running at the same time write there)."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__")
                       and not (dirpath == str(root) and d in ("prof", "dist"))]
        for name in filenames:
            path = os.path.join(dirpath, name)
            stat = os.stat(path)
            files[path] = (stat.st_size, stat.st_mtime_ns)
    return files


def test_cpu_run_writes_nothing_into_the_source_tree(tmp_path):
    """Run as a script from the repository root (JAX on CPU): every file goes to the temp dir's jax_flash_bench/."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    before = _tree(_ROOT)
    result = subprocess.run([sys.executable, "-B", str(_PATH), *ARGS], cwd=_ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _tree(_ROOT) == before
    out = tmp_path / "jax_flash_bench"
    assert f"Results go to {out}" in result.stdout
    assert sorted(p.suffix for p in out.iterdir()) == [".json", ".md"]


def test_table_names_the_best_peer_and_what_did_not_run(bench):
    """jax_flash's ratio against the fastest peer of each shape (cudnn, fa3_jax, tokamax), with the peer named;
    skipped implementations listed with the reason; fa3_jax's head-dim-128-only cells explained."""
    def row(impl, d, fwd, bwd, error=None):
        return dict(impl=impl, B=1, Sq=1024, Hq=16, Hkv=16, D=d, causal=False, fwd_tflops=fwd, bwd_tflops=bwd,
                    fwd_ms=1.0, fwd_latency_ms=1.0, rel_err=1e-3, error=error)

    rows = [row("jax_flash", 128, 100, 200), row("cudnn", 128, 90, 190), row("fa3_jax", 128, 110, 250),
            row("tokamax", 128, 120, 100),
            row("jax_flash", 64, 100, 200), row("cudnn", 64, 80, 100), row("tokamax", 64, 0, 0, error="OOM")]
    meta = dict(device="GPU", jax_version="0", date="today", dtype="bfloat16", skipped={"xla": "not asked"})
    md = bench.markdown(rows, meta)
    assert "Not run: xla: not asked." in md
    assert "fa3_jax runs at head dim 128 only" in md
    lines = {line.split(" | ")[0]: line.split(" | ") for line in md.splitlines() if line.startswith("| 1, 1024")}
    d128, d64 = lines["| 1, 1024, 16/16, 128, N"], lines["| 1, 1024, 16/16, 64, N"]
    assert d128[-3:-1] == ["0.83 (tokamax)", "0.80 (fa3_jax)"]  # fwd vs tokamax's 120, bwd vs fa3_jax's 250
    assert d64[-3:-1] == ["1.25 (cudnn)", "2.00 (cudnn)"]       # tokamax failed, fa3_jax did not run
    assert d64[3] == "–" and d64[4] == "error"                   # the fa3_jax and tokamax cells
    assert "jax_flash / best peer: forward geometric mean 1.02 (min 0.83), backward 1.26 (min 0.80)." in md


def test_peer_that_does_not_import_is_reported(bench, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)  # `import flash_attn3_jax` raises ImportError
    assert bench.missing_peer("fa3_jax").startswith("not installed (ModuleNotFoundError")
    assert bench.missing_peer("jax_flash") is None
    shape = bench.Shape(1, 512, 8, 8, 64, False)
    assert not bench.applies("fa3_jax", shape) and bench.applies("tokamax", shape)


@pytest.mark.parametrize("extra, message", [
    (["--shapes=-1x64x2x64"], "--shapes: cannot read '-1x64x2x64'"),
    (["--shapes", ","], "--shapes: no shape in ','"),
    (["--head-dims", "64,x"], "--head-dims: comma-separated integers"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--impls", "cudnn"], "--impls: nothing left to run here (cudnn: GPU only)"),
])
def test_bad_arguments_stop_before_any_measurement(bench, tmp_path, capsys, extra, message):
    if "GPU only" in message and any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("cudnn runs on a GPU")
    with pytest.raises(SystemExit) as stop:
        bench.main(ARGS + ["--out", str(tmp_path), "--name", "run"] + extra)
    captured = capsys.readouterr()
    assert message in f"{stop.value.code}{captured.err}" and not list(tmp_path.iterdir())


def test_out_that_cannot_be_created_is_an_error_at_the_start(bench, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        bench.main(ARGS + ["--out", str(tmp_path / "file" / "x")])
    err = capsys.readouterr().err
    assert "cannot create the results directory" in err and "1x16x2x64" not in err


def test_merge_of_parts_is_one_whole_run(bench, tmp_path):
    """Parts of one run (each a subset of the shapes) merge into one table without a partial-run label."""
    for name, shape in (("pa", "1x16x2x64"), ("pb", "1x24x2x64c")):
        args = ARGS[:ARGS.index("--shapes")] + ["--shapes", shape] + ARGS[ARGS.index("--shapes") + 2:]
        assert bench.main(args + ["--out", str(tmp_path), "--name", name]) == 0
    parts = [str(tmp_path / f"{name}.json") for name in ("pa", "pb")]
    assert bench.main(["--merge", *parts, "--out", str(tmp_path), "--name", "merged"]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert "partial" not in merged["meta"] and len(merged["rows"]) == 2


def test_merge_refuses_parts_of_different_runs_and_missing_files(bench, tmp_path, capsys):
    assert bench.main(ARGS + ["--out", str(tmp_path), "--name", "a"]) == 0
    other = json.loads((tmp_path / "a.json").read_text())
    other["meta"]["device"] = "another GPU"
    (tmp_path / "b.json").write_text(json.dumps(other))
    for files, message in (([tmp_path / "a.json", tmp_path / "b.json"], "parts of different runs"),
                           ([tmp_path / "missing.json"], "--merge: cannot read")):
        with pytest.raises(SystemExit):
            bench.main(["--merge", *map(str, files), "--out", str(tmp_path), "--name", "merged"])
        assert message in capsys.readouterr().err


def test_run_whose_every_row_failed_exits_nonzero(bench, tmp_path, monkeypatch, capsys):
    run_case = bench.run_case

    def failing(shape, *args):
        return dict(run_case(shape, *args), error="RuntimeError: out of memory")

    monkeypatch.setattr(bench, "run_case", failing)
    assert bench.main(ARGS + ["--out", str(tmp_path), "--name", "run"]) == 1
    assert "every row failed" in capsys.readouterr().err
    meta = json.loads((tmp_path / "run.json").read_text())["meta"]
    assert meta["jax_flash_version"] and meta["platform"] == jax.devices()[0].platform
