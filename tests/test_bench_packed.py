"""benchmarks/bench_packed.py on the CPU: without a GPU it is a smoke run of tiny sizes through every table; the
jax_flash rows are timed (pipelined and blocking), a peer that cannot run is a row with its error, the documents-as-
rows row appears for equal lengths only, the modifiers are relative to the plain kernel of the same run, and the
tables say that the timings are not performance numbers."""
import importlib.util
import json
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_packed.py"


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("bench_packed", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_every_table(bench, tmp_path):
    assert bench.main(["--out", str(tmp_path), "--name", "run", "--impls", "jax_flash,cudnn"]) == 0
    out = json.loads((tmp_path / "run.json").read_text())
    assert out["meta"]["smoke"] is True
    rows = out["rows"]
    packed = [r for r in rows if r["table"] == "packed"]
    for r in packed:
        if r["impl"].startswith("jax_flash"):
            assert r["ms"] > 0 and r["fwd_ms"] > 0 and r["latency_ms"] > 0 and r["tflops"] > 0, r
        else:  # cuDNN cannot run on the CPU: the row holds the reason
            assert r["impl"].startswith("cudnn") and "error" in r, r
    rows_row = [r for r in packed if "documents as rows" in r["impl"]]
    assert [r["doc_lengths"] for r in rows_row] == ["equal"]
    assert {r["doc_lengths"] for r in packed} == {"equal", "random"}
    assert not any(r["impl"].startswith("xla") for r in packed)  # --impls left it out
    mods = [r for r in rows if r["table"] == "modifiers"]
    plain = [r for r in mods if r["impl"] == "jax_flash"]
    assert len(plain) == 2 and all(r["fwd_vs_plain"] == 1.0 for r in plain)
    assert all(r["fwd_vs_plain"] > 0 for r in mods if r["impl"].startswith("jax_flash") and "fwd_ms" in r)
    text = (tmp_path / "run.md").read_text()
    assert "Smoke run without a GPU" in text and "documents as rows" in text


def test_sizes_given_on_the_command_line_win(bench, tmp_path):
    assert bench.main(["--out", str(tmp_path), "--name", "run", "--tables", "packed", "--doc-lengths", "equal",
                       "--impls", "jax_flash", "--tokens", "96", "--docs", "3"]) == 0
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert {(r["tokens"], r["docs"], r["batch"]) for r in rows} == {(96, 3, 1)}
    assert any("3 x 32 causal" in r["impl"] for r in rows)


@pytest.mark.parametrize("extra, message", [
    (["--doc-lengths", "both"], "--doc-lengths: unknown ['both']"),
    (["--tables", "modifier"], "--tables: unknown ['modifier']"),
    (["--impls", "jax_flash,triton"], "--impls: unknown ['triton']"),
    (["--mod-shape", "1x64"], "--mod-shape: BxTxHxD of positive integers"),
    (["--docs", "0"], "--docs must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--tokens", "63"], "--tokens (63) must be a multiple of --docs (4)"),
])
def test_bad_arguments_stop_before_any_measurement(bench, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--name", "run"] + extra)
    assert message in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_out_that_cannot_be_created_is_an_error_at_the_start(bench, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path / "file" / "x")])
    captured = capsys.readouterr()
    assert "cannot create the results directory" in captured.err and "[" not in captured.out
