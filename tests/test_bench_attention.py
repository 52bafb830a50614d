"""benchmarks/bench_attention.py on the CPU: a complete run writes its table and removes the partial file; a run
stopped after its first shape leaves that shape's rows in <stem>.partial.json, which --merge tabulates; the plot has
a panel only for the (head dim, causal) pairs with data; --head-dims matching no shape is an argument error."""
import importlib.util
import json
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_attention.py"


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
