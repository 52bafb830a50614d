"""benchmarks/bench_decode.py on the CPU: a smoke run writes its rows (with the fields the issue names) and table,
skips the GPU-only peers, and says it is a smoke run; bad arguments are clear errors."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
FIELDS = {"impl", "B", "Tq", "Sk", "Hq", "Hkv", "D", "paged", "page_size", "ragged", "us", "gbps", "kv_bytes",
          "pct_peak", "wall_us", "device", "jax_version"}


def _run(tmp_path, *extra):
    return subprocess.run([sys.executable, "-B", str(_PATH), "--calls", "1", "--reps", "1", "--out", str(tmp_path),
                           "--name", "run", *extra], cwd=tmp_path, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=600)


def test_smoke_run_writes_rows_and_table(tmp_path):
    result = _run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No GPU: a smoke run" in result.stdout
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {"jax_flash", "jax_flash_1len", "xla"}  # GPU-only peers do not apply
    assert all(not r["ragged"] for r in rows if r["impl"] == "jax_flash_1len")  # one length: equal rows only
    assert len([r for r in rows if r["impl"] == "jax_flash_1len"]) == 4  # Tq 1 and 4, dense and paged
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
    meta = json.loads((tmp_path / "run.json").read_text())["meta"]
    assert meta["timing"] == "program" and meta["shapes_done"] == meta["shapes"] == 2  # Tq 1 and 4
    assert "xla_flags" in meta
    assert "Medians of chained calls in one program" in md


def test_ragged_order_longest_first_keeps_the_lengths(tmp_path):
    drawn, longest = tmp_path / "drawn", tmp_path / "longest"
    drawn.mkdir()
    longest.mkdir()
    args = ("--lengths", "ragged", "--layouts", "dense", "--impls", "jax_flash")
    runs = [_run(drawn, *args), _run(longest, *args, "--ragged-order", "longest-first")]
    assert all(r.returncode == 0 for r in runs), [r.stdout + r.stderr for r in runs]
    rows = [json.loads((d / "run.json").read_text()) for d in (drawn, longest)]
    assert [m["meta"]["ragged_order"] for m in rows] == ["drawn", "longest-first"]
    # the same lengths (so the same bytes) on every row, only in another order
    assert [r["kv_bytes"] for r in rows[0]["rows"]] == [r["kv_bytes"] for r in rows[1]["rows"]]


def test_targets_check_each_way_of_passing_lengths():
    """The targets' check (>= 80 % of the peak at >= 64 MB, at or above every peer) covers jax_flash's rows and, in
    a section of its own, the equal-length rows with one length (jax_flash_1len), naming which missed."""
    bench = _bench()
    meta = dict(device="NVIDIA H200", platform="gpu", jax_version="0", date="today", peak_gbps=4800.0,
                timing="device")
    kv_bytes = 128 << 20

    def row(impl, us, ragged=False):
        gbps = kv_bytes / us / 1e3
        return dict(impl=impl, B=8, Tq=1, Sk=32768, Hq=8, Hkv=1, D=128, paged=False, page_size=None, ragged=ragged,
                    kv_bytes=kv_bytes, us=us, gbps=gbps, pct_peak=100 * gbps / 4800, wall_us=us, error=None)

    rows = [row("jax_flash", 39.0), row("jax_flash_1len", 36.0), row("cudnn", 37.8),
            row("jax_flash", 24.0, True), row("cudnn", 25.0, True)]
    md = bench.markdown(rows, meta)
    main, one = md.split("### Equal-length rows with kv_lengths as one scalar")
    assert "2 misses" in main and "cudnn faster than jax_flash (37.8 vs 39.0 µs)" in main
    assert "jax_flash 72% of peak (< 80%)" in main
    assert one.startswith(" (jax_flash_1len, 1 rows): 1 misses")  # 36 us: 78 % of the peak, ahead of cudnn
    assert "jax_flash_1len 78% of peak (< 80%)" in one and "faster than jax_flash_1len" not in one


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_decode", _PATH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_program_timing_chains_calls_over_cache_copies():
    """Program timing: each call's output is the next call's query (the calls cannot overlap), and caches under
    L2_FLUSH_BYTES are copied (distinct buffers, one per call at most) so that consecutive calls read different ones."""
    import jax
    import jax.numpy as jnp

    bench = _bench()
    q, k = jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 64, 1, 8))
    caches = bench._cache_copies(k, k, "program", calls=3)
    assert len(caches) == 3 and len({id(c[0]) for c in caches}) == 3  # a 4 KB cache: one copy per call
    big = jnp.zeros((bench.L2_FLUSH_BYTES // 2 // 4,), jnp.float32)
    assert len(bench._cache_copies(big, big, "program", calls=3)) == 1
    assert len(bench._cache_copies(k, k, "pipelined", calls=3)) == 1
    seen = []

    def fn(q, k, v, n, table):
        seen.append(k)
        return q + 1

    out = jax.jit(bench._chained(fn, 5))(q, caches, None, None)
    assert (out == 5).all()  # five calls, each on the previous one's output
    assert len(seen) == 5 and len({id(k) for k in seen}) == 5  # a fresh cache value per call
    us, wall_us = bench._time_us(fn, q, caches, None, None, calls=3, reps=1, timing="program")
    assert us > 0 and wall_us > 0


def test_timing_warms_up_and_fills_each_repetition(monkeypatch):
    """Untimed runs first (at least two units after the compile), then `reps` repetitions of the same number k of
    units each, k large enough that a repetition lasts MIN_REP_S (one host synchronisation per repetition)."""
    import jax
    import jax.numpy as jnp

    bench = _bench()
    runs = []

    def fn(q, k, v, n, table):
        jax.debug.callback(lambda: runs.append(1))
        return q + 1

    q, k = jnp.ones((1, 1, 2, 8)), jnp.ones((1, 64, 1, 8))
    monkeypatch.setattr(bench, "MIN_REP_S", 0.0)  # k = 1
    assert bench._time_us(fn, q, [(k, k)], None, None, calls=3, reps=4, timing="pipelined", warmup_s=0.0)[0] > 0
    jax.effects_barrier()
    assert len(runs) == 3 * (1 + 2 + 4)  # compile run, two warm-up units, four repetitions of one unit
    runs.clear()
    monkeypatch.setattr(bench, "MIN_REP_S", 0.05)  # k > 1: more than a unit of three trivial calls takes
    bench._time_us(fn, q, [(k, k)], None, None, calls=3, reps=2, timing="pipelined", warmup_s=0.0)
    jax.effects_barrier()
    units = len(runs) // 3 - 3
    assert len(runs) % 3 == 0 and units % 2 == 0 and units // 2 > 1


def test_program_timing_keeps_each_calls_cache_work():
    """One cache copy for every call: work that depends on the cache alone (jax.nn xla's K/V transposes) is not
    merged across the chained calls (the optimization barrier), as a model's layers each read their own cache."""
    import jax
    import jax.numpy as jnp

    if jax.__version_info__ < (0, 11):
        pytest.skip("XLA before jax 0.11 merges such work across optimization barriers (the GPU machine runs 0.11)")
    bench = _bench()

    def fn(q, k, v, n, table):  # cache-only work: a reduction of k that does not depend on q
        return q + jnp.sum(k * k)

    q, k = jnp.ones((1, 1, 2, 8)), jnp.ones((1, 64, 1, 8))

    def reductions(calls):  # reduce / reduce-window instructions of the optimised program (XLA versions differ)
        hlo = jax.jit(bench._chained(fn, calls)).lower(q, [(k, k)], None, None).compile().as_text()
        return len(re.findall(r"\s(?:reduce|reduce-window)\(", hlo))

    assert reductions(1) >= 1 and reductions(4) == 4 * reductions(1)


def test_device_timing_spans_each_program():
    """Device timing: each program's span runs from its first event's start to its last event's end (events of
    several streams may overlap); programs are told apart by their equal event counts; anything else (no GPU
    activity traced, as on a CPU) is a clear error, not a number."""
    bench = _bench()
    events = [(0, 5_000, "split"), (5_000, 6_000, "combine"),           # program 1: 6 us
              (50_000, 59_000, "split"), (51_000, 60_000, "combine")]  # program 2: 10 us, overlapping events
    assert bench.program_spans_us(events, 2) == [6.0, 10.0]
    assert bench.program_spans_us(events, 1) == [60.0]
    for bad, programs in (([], 1), (events[:3], 2)):
        with pytest.raises(RuntimeError, match="device timing.*--timing program"):
            bench.program_spans_us(bad, programs)
    # a stray event that keeps the counts even: the programs' kernel sequences differ, an error, not a shifted span
    stray = [(0, 5_000, "split"), (5_000, 6_000, "memcpy"), (50_000, 52_000, "split"), (51_000, 60_000, "combine")]
    with pytest.raises(RuntimeError, match="did not run the same"):
        bench.program_spans_us(stray, 2)


def test_device_timing_without_gpu_events_is_a_clear_error():
    import jax.numpy as jnp

    bench = _bench()
    q, k = jnp.ones((1, 1, 2, 8)), jnp.ones((1, 64, 1, 8))
    with pytest.raises(RuntimeError, match="device timing: 0 GPU events"):
        bench._time_us(lambda q, k, v, n, t: q + 1, q, [(k, k)], None, None, calls=2, reps=2, timing="device",
                       warmup_s=0.0)


def test_pipelined_timing_runs(tmp_path):
    result = _run(tmp_path, "--timing", "pipelined", "--layouts", "dense", "--lengths", "equal")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((tmp_path / "run.json").read_text())["meta"]["timing"] == "pipelined"


def test_unknown_layout_is_an_error(tmp_path):
    result = _run(tmp_path, "--layouts", "paged32")
    assert result.returncode != 0 and "--layouts: unknown ['paged32']" in result.stderr


def test_bs_replaces_the_presets_pairs(tmp_path):
    result = _run(tmp_path, "--bs", "3x40", "--tq", "1", "--layouts", "dense", "--lengths", "equal",
                  "--impls", "jax_flash")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert [(r["B"], r["Sk"]) for r in rows] == [(3, 40)]


@pytest.mark.parametrize("bad", ["3", "3x", "0x40", "3x40x2"])
def test_bad_bs_is_an_error(tmp_path, bad):
    result = _run(tmp_path, "--bs", bad)
    assert result.returncode != 0 and "--bs: pairs BxS of positive integers" in result.stderr


@pytest.mark.parametrize("extra, message", [
    (["--heads", "4/2"], "--heads: Hq/Hkv/D triples"),
    (["--heads", "3/2/64"], "Hq a multiple of Hkv"),
    (["--tq", "1,x"], "--tq: query rows from 1 to 16"),
    (["--tq", "0"], "--tq: query rows from 1 to 16"),
    (["--calls", "0"], "--calls must be >= 1"),
    (["--bs", "1x100", "--layouts", "paged16"], "needs S a multiple of 16; got 1x100"),
])
def test_bad_arguments_are_usage_errors(tmp_path, extra, message):
    result = _run(tmp_path, *extra)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "run.json").exists()


def test_out_that_cannot_be_created_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("")
    result = subprocess.run([sys.executable, "-B", str(_PATH), "--out", str(tmp_path / "file" / "x")], cwd=tmp_path,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "cannot create the results directory" in result.stderr, result.stderr
