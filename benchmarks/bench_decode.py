"""Decode: a few query rows against a long key/value cache, jax_flash.decode_attention beside the peers, in one run.

Metric: bytes of K and V a call must read (sum over sequences of kv_length x Hkv x D x 2 tensors x 2 bytes) per
second of its median time (2 bytes an element in bfloat16; the CPU smoke run's float32 counts 4), and that as a percentage of the device's HBM peak (H200 4.8 TB/s, H100 3.35 TB/s).
Timing (`--timing`, the median over `--reps` repetitions of a time divided by the calls it covers; before them,
--warmup seconds of untimed runs (clocks settle after the previous row's compile)):
  device     (default on a GPU) one jitted program makes `--calls` calls one after another (each call's output is
             the next one's query, so they cannot overlap, as a model's layers do not); each repetition runs it
             once under JAX's profiler (CUPTI), and its time is the GPU's: from the program's first kernel's (or
             copy's) start to its last one's end (the calls' kernels and the gaps between them), as a decode step
             inside a jitted model sees it. While it profiles, XLA launches the program op by op instead of as CUDA
             graphs (its flag xla_enable_command_buffers_during_profiling), so the gaps between a call's kernels
             are those of op-by-op launches: 0-3 µs per call in the traces of 2026-11-24, more for implementations
             with more kernels per call (XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true keeps the
             graphs; meta records XLA_FLAGS). Neither the host's dispatch of the program nor its synchronisation counts: on an
             H200 they added 8-20 % to the wall-clock time of a 20-call program of large calls, and varied it by
             up to 10 % between runs of one build (2026-11-24, `tools/timeline_decode.py`), while the traced
             spans repeat within 0.5 %. The row also keeps `wall_us`, the wall-clock time per call of the
             warm-up's programs (dispatch and synchronisation included). Caches under 256 MB are copied (at most
             one copy per call) so that consecutive calls read different ones: from 256 MB / (calls - 1) up
             (13 MB at 20 calls), 256 MB (five times the 50 MB L2) are read between two reads of one copy, so no
             call finds its cache in L2 (smaller caches still may). Each call's cache passes through an
             optimization barrier, so XLA cannot merge work that depends on the cache alone across calls (the
             xla path's K/V transposes: each layer of a model reads its own cache; jax >= 0.11: older XLA merges
             across the barrier);
  program    (the default without a GPU; the GPU results up to 2026-11-23) the same program timed by the wall
             clock: each repetition runs it back to back as many times as fill about 5 ms, then synchronises
             once (the host's dispatch and synchronisation included);
  pipelined  `--calls` jitted calls enqueued back to back from Python on one cache, wall clock as `program`
             (Python dispatch overlaps the kernels where a call takes longer than its dispatch; a cache below the
             L2 size may be served partly from it and show more than the HBM peak).

Matrix (issue 19): (Hq, Hkv, D) in {(32, 8, 128), (64, 8, 128), (8, 1, 128), (16, 8, 256)} x Tq in {1, 4, 16} x
B in {1, 8, 64, 256} x S in {1k, 8k, 32k, 128k} (caches over --max-cache-gb skipped), each with equal lengths (the
full cache) and ragged ones (uniform in [1, S]; `--ragged-order longest-first` hands the same lengths over sorted
longest first, which measures what the batch's order costs a grid), dense and paged (pages of 16 and 64 keys, in
shuffled order).
`--preset core` takes a subset (every head configuration, Tq 1 and 16, four (B, S) pairs); `--preset smoke` is a
tiny CPU-sized run (the default without a GPU: not performance numbers). `--bs` replaces a preset's (B, S) pairs
(any, e.g. `--bs 256x8192,300x4096`).

Implementations (those that apply to a row; a failure is recorded with its error):
  jax_flash     jax_flash.decode_attention (bottom-right causal), num_splits chosen by jax_flash
  jax_flash_1len  the same with kv_lengths given as one scalar (equal-length rows only): what a caller whose
                sequences are all equally long passes, for which jax_flash plans the splits of equal lengths
  jax_flash_sm80  the same with the sm_80-class (mma.sync) decode kernel forced (jax_flash.force_kernel): on an
                H100/H200 the comparison with the sm_90a kernel jax_flash picks for many packed rows (not run
                unless named in --impls)
  cudnn         jax.nn.dot_product_attention(implementation="cudnn"): dense, Tq = 1, key_value_seq_lengths
  xla           jax.nn.dot_product_attention(implementation="xla"): dense, key_value_seq_lengths (at Tq > 1 not
                causal: jax.nn has no bottom-right causal mask; the same bytes)
  fa3_jax       flash_attn3_jax.flash_mha_with_kvcache (dense and paged, causal, cache_seqlens) with the num_splits
                jax_flash chooses (its own default is 1 split)
  tokamax       tokamax.dot_product_attention(implementation="mosaic"): dense, Tq = 1

Writes <out>/<name>.json (rows: impl, B, Tq, Sk, Hq, Hkv, D, paged, page_size, ragged, us, gbps, kv_bytes,
pct_peak, wall_us, device, jax_version, error; rewritten after every shape, its meta counting the shapes done, so a
run cut short keeps its rows) and <name>.md (tables and the targets' check), and <name>.png when matplotlib is
installed.
    python3 benchmarks/bench_decode.py [--preset full|core|smoke] [--impls ...] [--out DIR]
"""

import argparse
import datetime
import glob
import itertools
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _ffi

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SMOKE_OUT = os.path.join(tempfile.gettempdir(), "jax_flash_bench")
ALL_IMPLS = ("jax_flash", "jax_flash_1len", "jax_flash_sm80", "cudnn", "xla", "fa3_jax", "tokamax")
PEERS = ("cudnn", "xla", "fa3_jax", "tokamax")
DEFAULT_IMPLS = ("jax_flash", "jax_flash_1len") + PEERS
HEADS = ((32, 8, 128), (64, 8, 128), (8, 1, 128), (16, 8, 256))
#: HBM peak in GB/s by device kind (substring match).
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}
TARGET_MIN_BYTES = 64 << 20

PRESETS = {
    "full": dict(heads=HEADS, tq=(1, 4, 16), bs=tuple(itertools.product((1, 8, 64, 256),
                                                                      (1024, 8192, 32768, 131072))),
                 layouts=("dense", "paged16", "paged64"), lengths=("equal", "ragged")),
    "core": dict(heads=HEADS, tq=(1, 16), bs=((1, 131072), (8, 32768), (64, 8192), (256, 1024)),
                 layouts=("dense", "paged16", "paged64"), lengths=("equal", "ragged")),
    "smoke": dict(heads=((4, 2, 64),), tq=(1, 4), bs=((2, 256),), layouts=("dense", "paged16"),
                  lengths=("equal", "ragged")),
}


def peak_gbps(device_kind):
    return next((v for k, v in PEAK_GBPS.items() if k in device_kind), None)


#: Caches smaller than this are copied for program timing, so that (from L2_FLUSH_BYTES / (calls - 1) up) no call
#: reads a cache the L2 still holds.
L2_FLUSH_BYTES = 256 << 20


def _chained(fn, calls):
    """(q, caches, n, table) -> the last of `calls` calls of fn, each call's query the previous call's output (a
    data dependency, no extra kernel: the calls run one after another) and its cache caches[i % len(caches)] through
    an optimization barrier (a fresh value per call: no cache-only work, such as a transpose, is shared)."""
    def chain(q, caches, n, table):
        for i in range(calls):
            q, k, v = jax.lax.optimization_barrier((q, *caches[i % len(caches)]))
            out = fn(q, k, v, n, table)
            if out.shape != q.shape or out.dtype != q.dtype:
                raise TypeError(f"program timing chains calls: an output like the query, got {out.shape} {out.dtype}")
            q = out
        return q
    return chain


#: Each wall-clock repetition runs the unit (a program of `calls` calls, or `calls` pipelined calls) this long at
#: least.
MIN_REP_S = 0.005


def gpu_events(xplane_path):
    """[(start_ns, end_ns, name)] of the kernels and copies on the GPU planes' stream lines of a JAX profiler
    trace, sorted by start (an event listed on two lines, a stream's and an aggregate's, once)."""
    from jax.profiler import ProfileData

    events = set()
    for plane in ProfileData.from_file(xplane_path).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events.update((int(e.start_ns), int(e.start_ns + e.duration_ns), e.name) for e in line.events)
    return sorted(events)


def traced_gpu_events(work):
    """GPU events of work() run under JAX's profiler."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            work()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return gpu_events(paths[0]) if paths else []


def program_spans_us(events, programs):
    """Microseconds from the first event's start to the last one's end of each of `programs` programs that ran
    one after another (the host waiting for each): equal numbers of events each, in order of start, each program
    the same sequence of kernels and copies (so that an event of something else cannot shift the programs' bounds
    unnoticed)."""
    if not events or len(events) % programs:
        raise RuntimeError(f"device timing: {len(events)} GPU events traced for {programs} programs (no GPU "
                           "activity recorded by JAX's profiler, or programs of different kernels); "
                           "use --timing program")
    per = len(events) // programs
    groups = [events[i * per:(i + 1) * per] for i in range(programs)]
    names = [n for _, _, n in groups[0]]
    if any([n for _, _, n in g] != names for g in groups[1:]):
        raise RuntimeError(f"device timing: the {programs} traced programs did not run the same {per} kernels and "
                           "copies (GPU work from elsewhere in the trace?); use --timing program")
    return [(max(e for _, e, _ in g) - g[0][0]) / 1e3 for g in groups]


def check_device_timing():
    """Raises with the --timing program advice where JAX's profiler records no GPU activity here (no CUPTI, no
    permission), before any row pays its warm-up."""
    x = jnp.ones((256, 256), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready(f(x))
    if not traced_gpu_events(lambda: jax.block_until_ready(f(x))):
        raise SystemExit("--timing device: JAX's profiler recorded no GPU activity on this machine (CUPTI missing "
                         "or not permitted?); use --timing program")


def _time_us(fn, q, caches, n, table, calls, reps, timing, warmup_s=0.05):
    """(median microseconds per call, wall-clock microseconds per call) of fn(q, k_cache, v_cache, n, table): a unit
    is `calls` chained calls in one jitted program over copies of the caches (timings "device", "program"), or
    `calls` jitted calls enqueued from Python on the first copy ("pipelined"). Compiled, then run untimed for at
    least `warmup_s` seconds (twice at least: the GPU's clocks settle after the idle compile; the second value is
    their wall-clock time per call). "device": each of `reps` programs traced, its GPU span; otherwise each of
    `reps` repetitions enqueues k units back to back (k from the warm-up's time per unit, enough for MIN_REP_S)
    and blocks once."""
    if timing in ("device", "program"):
        run = jax.jit(_chained(fn, calls))
        go = lambda: run(q, caches, n, table)  # noqa: E731
    else:
        jitted = jax.jit(fn)
        go = lambda: [jitted(q, *caches[0], n, table) for _ in range(calls)]  # noqa: E731
    jax.block_until_ready(go())
    units, t0 = 0, time.perf_counter()
    while units < 2 or time.perf_counter() - t0 < warmup_s:
        jax.block_until_ready(go())
        units += 1
    per_unit = (time.perf_counter() - t0) / units
    wall_us = per_unit / calls * 1e6
    if timing == "device":
        events = traced_gpu_events(lambda: [jax.block_until_ready(go()) for _ in range(reps)])
        return statistics.median(program_spans_us(events, reps)) / calls, wall_us
    k = max(1, int(np.ceil(MIN_REP_S / max(per_unit, 1e-9))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready([go() for _ in range(k)])
        times.append((time.perf_counter() - t0) / (k * calls))
    return statistics.median(times) * 1e6, wall_us


def _cache_copies(kc, vc, timing, calls):
    """[(k, v)]: the caches, and for program timing copies of small ones, enough that L2_FLUSH_BYTES lie between two
    reads of one copy where `calls` copies suffice (at most one copy per call)."""
    nbytes = 2 * kc.size * kc.dtype.itemsize
    copies = (1 if timing == "pipelined" or nbytes >= L2_FLUSH_BYTES
              else max(1, min(calls, -(-L2_FLUSH_BYTES // nbytes) + 1)))
    return [(kc, vc)] + [(kc.copy(), vc.copy()) for _ in range(copies - 1)]


def _fa3():
    try:
        import flash_attn3_jax
        return flash_attn3_jax.flash_mha_with_kvcache, None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"


def _tokamax():
    try:
        import tokamax
        return tokamax.dot_product_attention, None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"


def implementations(impl, tq, layout, num_splits, platform="gpu", ragged=False):
    """The function (q, k_cache, v_cache, lengths, page_table) -> out of `impl` for this row, or (None, why)."""
    paged = layout != "dense"
    if impl in ("cudnn", "fa3_jax", "tokamax") and platform != "gpu":
        return None, "GPU only"
    if impl == "jax_flash":
        def f(q, k, v, n, table):
            return jax_flash.decode_attention(q, k, v, n, page_table=table)
        return f, None
    if impl == "jax_flash_1len":
        if ragged:
            return None, "equal lengths only"

        def f(q, k, v, n, table):  # n: the one length (rows_for_shape passes it), or the equal lengths (B,)
            return jax_flash.decode_attention(q, k, v, n if n.ndim == 0 else n[0], page_table=table)
        return f, None
    if impl == "jax_flash_sm80":
        if platform != "gpu":
            return None, "GPU only"

        def f(q, k, v, n, table):  # the kernel choice is made while jit traces this
            with jax_flash.force_kernel("sm80"):
                return jax_flash.decode_attention(q, k, v, n, page_table=table)
        return f, None
    if impl in ("cudnn", "xla"):
        if paged:
            return None, "dense caches only"
        if impl == "cudnn" and tq != 1:
            return None, "Tq = 1 only (no bottom-right causal mask)"

        def f(q, k, v, n, table):
            return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n, implementation=impl)
        return f, None
    if impl == "fa3_jax":
        fa3, why = _fa3()
        if fa3 is None:
            return None, f"not installed ({why})"

        def f(q, k, v, n, table):
            return fa3(q, k, v, cache_seqlens=n, page_table=table, is_causal=True, num_splits=num_splits)
        return f, None
    if impl == "tokamax":
        if paged or tq != 1:
            return None, "dense, Tq = 1 only"
        tok, why = _tokamax()
        if tok is None:
            return None, f"not installed ({why})"

        def f(q, k, v, n, table):
            return tok(q, k, v, key_value_seq_lengths=n, implementation="mosaic")
        return f, None
    raise ValueError(impl)


def _paged(k, v, page_size, key):
    """The dense caches as pools of pages in shuffled order, and the page table that reads them back."""
    b, s, h, d = k.shape
    per = s // page_size
    perm = jax.random.permutation(key, b * per)
    inv = jnp.argsort(perm).astype(jnp.int32)
    pool = lambda x: x.reshape(b * per, page_size, h, d)[perm]  # noqa: E731  pool[i] = page perm[i]
    return pool(k), pool(v), inv.reshape(b, per)  # table[b, j] = where page b * per + j went


def rows_for_shape(args, meta, hq, hkv, d, tq, b, s, progress):
    rows = []
    key = jax.random.PRNGKey(b * 7 + s + tq + hq)
    kq, kk, kv, kl, kp = jax.random.split(key, 5)
    dtype = jnp.bfloat16 if meta["platform"] == "gpu" else jnp.float32
    q = jax.random.normal(kq, (b, tq, hq, d), dtype)
    k = jax.random.normal(kk, (b, s, hkv, d), dtype)
    v = jax.random.normal(kv, (b, s, hkv, d), dtype)
    for lengths_kind in args.lengths:
        if lengths_kind == "equal":
            n = jnp.full((b,), s, jnp.int32)
        else:
            n = jax.random.randint(kl, (b,), max(tq, 1), s + 1, jnp.int32)
            if args.ragged_order == "longest-first":  # the same lengths, bytes and kernels; only the order differs
                n = -jnp.sort(-n)
        kv_bytes = int(np.asarray(n, np.int64).sum()) * hkv * d * 2 * jnp.dtype(dtype).itemsize
        for layout in args.layouts:
            page_size = int(layout[5:]) if layout != "dense" else None
            if page_size:
                kc, vc, table = _paged(k, v, page_size, kp)
            else:
                kc, vc, table = k, v, None
            caches = _cache_copies(kc, vc, args.timing, args.calls)
            # jax_flash's split count, for fa3_jax (GPU only)
            splits = _ffi.decode_splits(q.shape, hkv, s, page_size is not None) if meta["platform"] == "gpu" else None
            for impl in args.impls:
                fn, why = implementations(impl, tq, layout, splits, meta["platform"], lengths_kind == "ragged")
                row = dict(impl=impl, B=b, Tq=tq, Sk=s, Hq=hq, Hkv=hkv, D=d, paged=page_size is not None,
                           page_size=page_size, ragged=lengths_kind == "ragged", kv_bytes=kv_bytes, us=None,
                           gbps=None, pct_peak=None, wall_us=None, device=meta["device"],
                           jax_version=meta["jax_version"], error=None)
                if fn is None:
                    continue  # does not apply (not a row)
                try:
                    lens = n[0] if impl == "jax_flash_1len" else n  # one scalar for every sequence
                    us, wall_us = _time_us(fn, q, caches, lens, table, args.calls, args.reps, args.timing,
                                           args.warmup)
                    row.update(us=round(us, 2), gbps=round(kv_bytes / us / 1e3, 1), wall_us=round(wall_us, 2))
                    if meta["peak_gbps"]:
                        row["pct_peak"] = round(100 * row["gbps"] / meta["peak_gbps"], 1)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                shown = (f"{row['us']:9.1f} us {row['gbps']:8.1f} GB/s" if row["error"] is None
                         else f"error: {row['error'][:80]}")
                progress(f"B={b} Tq={tq} S={s} {hq}/{hkv}x{d} {lengths_kind:6s} {layout:7s} {impl:14s} {shown}")
            del kc, vc, table, caches
    return rows


def _fmt(r):
    if r is None:
        return "–"
    if r["error"]:
        return "error"
    pct = f", {r['pct_peak']:.0f}%" if r["pct_peak"] is not None else ""
    rate = f"{r['gbps'] / 1e3:.2f} TB/s" if r["gbps"] >= 100 else f"{r['gbps']:.2g} GB/s"
    return f"{r['us']:.1f} µs ({rate}{pct})"


def _target_misses(where, ours, group, kv_mb):
    """Issue 19's targets on one row for one of jax_flash's rows (`ours`): >= 80 % of the HBM peak at >= 64 MB of
    K and V, and at or above every peer that ran."""
    misses = []
    if kv_mb * 2**20 >= TARGET_MIN_BYTES and ours["pct_peak"] is not None and ours["pct_peak"] < 80:
        misses.append(f"{where}: {ours['impl']} {ours['pct_peak']:.0f}% of peak (< 80%)")
    for i, r in group.items():
        if i in PEERS and r["error"] is None and r["us"] < ours["us"]:
            misses.append(f"{where}: {i} faster than {ours['impl']} ({r['us']:.1f} vs {ours['us']:.1f} µs)")
    return misses


def markdown(rows, meta):
    impls = [i for i in ALL_IMPLS if any(r["impl"] == i for r in rows)]
    by = {}
    for r in rows:
        by.setdefault((r["Hq"], r["Hkv"], r["D"], r["Tq"], r["B"], r["Sk"], r["ragged"], r["paged"],
                       r["page_size"]), {})[r["impl"]] = r
    lines = [f"# Decode benchmark: {meta['device']}, jax {meta['jax_version']}, {meta['date']}", "",
             ("Smoke run without a GPU: the timings are not performance numbers. " if meta["platform"] != "gpu"
              else "") +
             {"device": "Medians of chained calls in one program, the GPU's time per call (the program's traced "
                        "span: kernels and the gaps between them; the host's dispatch and synchronisation not "
                        "counted); small caches copied out of L2",
              "program": "Medians of chained calls in one program, wall-clock time per call (the host's dispatch "
                         "and synchronisation included); small caches copied out of L2",
              }.get(meta.get("timing", "pipelined"), "Pipelined medians") +
             f"; TB/s = bytes of K and V read per second; % of the HBM peak "
             f"({meta['peak_gbps']} GB/s). xla rows at Tq > 1 are not causal (jax.nn has no bottom-right causal "
             "mask); fa3_jax runs with jax_flash's split count.", "",
             "| Hq/Hkv, D | Tq | B | S | lengths | layout | KV MB | " + " | ".join(impls) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(impls)]
    misses, misses_1len, equal_1len = [], [], 0
    for key, group in by.items():
        hq, hkv, d, tq, b, s, ragged, paged, ps = key
        kv_mb = next(iter(group.values()))["kv_bytes"] / 2**20
        lines.append(f"| {hq}/{hkv}, {d} | {tq} | {b} | {s} | {'ragged' if ragged else 'equal'} | "
                     f"{f'paged {ps}' if paged else 'dense'} | {kv_mb:.0f} | " +
                     " | ".join(_fmt(group.get(i)) for i in impls) + " |")
        where = (f"Hq/Hkv {hq}/{hkv} D {d} Tq {tq} B {b} S {s} {'ragged' if ragged else 'equal'} "
                 f"{f'paged {ps}' if paged else 'dense'}")
        ours = group.get("jax_flash")
        if ours is None or ours["error"]:
            misses.append(f"{where}: jax_flash did not run")
        else:
            misses += _target_misses(where, ours, group, kv_mb)
        one = group.get("jax_flash_1len")
        if one is not None and not one["error"]:
            equal_1len += 1
            misses_1len += _target_misses(where, one, group, kv_mb)
    errors = sorted({f"{r['impl']}: {r['error']}" for r in rows if r["error"]})
    if meta.get("not_installed"):
        lines += ["", "Not installed in this run (no rows): " +
                  "; ".join(f"{k} ({v})" for k, v in meta["not_installed"].items())]
    if meta["platform"] == "gpu":
        lines += ["", f"## Targets (>= 80% of peak at >= 64 MB of KV; at or above every peer): "
                      f"{'all met' if not misses else f'{len(misses)} misses'}", ""]
        lines += [f"- {m}" for m in misses]
        if equal_1len:
            lines += ["", f"### Equal-length rows with kv_lengths as one scalar (jax_flash_1len, {equal_1len} rows): "
                          f"{'all met' if not misses_1len else f'{len(misses_1len)} misses'}", ""]
            lines += [f"- {m}" for m in misses_1len]
    else:
        lines += ["", "Targets not checked (smoke run)."]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


def plot(rows, meta, path):
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install '.[bench]')", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = dict(zip(ALL_IMPLS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, paged in zip(axes, (False, True)):
        for impl in ALL_IMPLS:
            pts = [(r["kv_bytes"] / 2**20, r["gbps"] / 1e3) for r in rows
                   if r["impl"] == impl and r["paged"] == paged and r["error"] is None and not r["ragged"]]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.scatter(xs, ys, label=impl, s=14, color=colors[impl])
        if meta["peak_gbps"]:
            ax.axhline(meta["peak_gbps"] / 1e3, color="gray", ls="--", lw=1, label="HBM peak")
            ax.axhline(0.8 * meta["peak_gbps"] / 1e3, color="gray", ls=":", lw=1, label="80% of peak")
        ax.set_xscale("log")
        ax.set_xlabel("K + V bytes per call (MB)")
        ax.set_title(("paged" if paged else "dense") + " caches, equal lengths")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("TB/s of K and V read")
    fig.suptitle(f"Decode: {meta['device']}, jax {meta['jax_version']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="matrix (default: full on a GPU, smoke without one)")
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"from {','.join(ALL_IMPLS)}")
    parser.add_argument("--heads", default=None, help="subset of Hq/Hkv/D, e.g. 32/8/128,8/1/128")
    parser.add_argument("--tq", default=None, help="subset of Tq, e.g. 1,16")
    parser.add_argument("--layouts", default=None, help="dense,paged16,paged64")
    parser.add_argument("--lengths", default=None, help="equal,ragged")
    parser.add_argument("--bs", default=None, help="(B, S) pairs instead of the preset's, e.g. 256x8192,300x4096")
    parser.add_argument("--ragged-order", choices=("drawn", "longest-first"), default="drawn",
                        help="ragged lengths as drawn (default) or sorted longest first")
    parser.add_argument("--max-cache-gb", type=float, default=40.0, help="skip shapes whose K + V exceed this")
    parser.add_argument("--calls", type=int, default=20, help="calls per timed repetition")
    parser.add_argument("--timing", choices=("device", "program", "pipelined"), default=None,
                        help="device (default on a GPU): a program of chained calls, its GPU span per call from "
                             "JAX's profiler; program (default without one): that program's wall-clock time; "
                             "pipelined: jitted calls from Python")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=float, default=0.05,
                        help="seconds of untimed runs before a row's repetitions (at least two runs)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default=None, help="file stem (default decode-<device>-<date>)")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    platform = device.platform
    preset = PRESETS[args.preset or ("full" if platform == "gpu" else "smoke")]
    args.timing = args.timing or ("device" if platform == "gpu" else "program")
    if args.timing == "device":
        check_device_timing()
    try:
        heads = preset["heads"] if args.heads is None else tuple(tuple(int(x) for x in h.split("/"))
                                                                 for h in args.heads.split(","))
        if any(len(h) != 3 or min(h) < 1 or h[0] % h[1] for h in heads):
            raise ValueError
    except ValueError:
        parser.error(f"--heads: Hq/Hkv/D triples of positive integers, Hq a multiple of Hkv, e.g. 32/8/128; got "
                     f"{args.heads!r}")
    try:
        tqs = preset["tq"] if args.tq is None else tuple(int(x) for x in args.tq.split(","))
        if any(not 1 <= tq <= jax_flash.decode.MAX_QUERY_ROWS for tq in tqs):
            raise ValueError
    except ValueError:
        parser.error(f"--tq: query rows from 1 to {jax_flash.decode.MAX_QUERY_ROWS}, e.g. 1,16; got {args.tq!r}")
    for name in ("calls", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    args.layouts = preset["layouts"] if args.layouts is None else tuple(args.layouts.split(","))
    args.lengths = preset["lengths"] if args.lengths is None else tuple(args.lengths.split(","))
    args.impls = tuple(args.impls.split(","))
    try:
        bs = preset["bs"] if args.bs is None else tuple((int(b), int(s)) for b, s in
                                                        (pair.split("x") for pair in args.bs.split(",")))
        if any(b < 1 or s < 1 for b, s in bs):
            raise ValueError
    except ValueError:
        parser.error(f"--bs: pairs BxS of positive integers, e.g. 256x8192,64x8192; got {args.bs!r}")
    for layout in args.layouts:
        page = int(layout[len("paged"):]) if layout.startswith("paged") and layout[len("paged"):].isdigit() else 0
        uneven = [f"{b}x{s}" for b, s in bs if page and s % page]
        if uneven:
            parser.error(f"--bs: a paged cache of {page}-key pages ({layout}) needs S a multiple of {page}; got "
                         f"{', '.join(uneven)}")
    for name, values, allowed in (("--impls", args.impls, ALL_IMPLS),
                                  ("--layouts", args.layouts, ("dense", "paged16", "paged64")),
                                  ("--lengths", args.lengths, ("equal", "ragged"))):
        bad = [x for x in values if x not in allowed]
        if bad:
            parser.error(f"{name}: unknown {bad}; choose from {list(allowed)}")
    meta = dict(device=device.device_kind, platform=platform, jax_version=jax.__version__,
                jax_flash_version=jax_flash.__version__,
                date=datetime.date.today().isoformat(), peak_gbps=peak_gbps(device.device_kind),
                preset=args.preset or ("full" if platform == "gpu" else "smoke"), timing=args.timing,
                calls=args.calls, reps=args.reps, warmup_s=args.warmup, min_rep_s=MIN_REP_S,
                xla_flags=os.environ.get("XLA_FLAGS", ""), ragged_order=args.ragged_order)
    missing = {name: why for name, (fn, why) in (("fa3_jax", _fa3()), ("tokamax", _tokamax()))
               if name in args.impls and fn is None and platform == "gpu"}
    meta["not_installed"] = missing
    for name, why in missing.items():
        print(f"{name} is not installed here ({why}): no {name} rows", flush=True)
    if platform != "gpu":
        print("No GPU: a smoke run (tiny shapes; not performance numbers)", flush=True)
    shapes = [(hq, hkv, d, tq, b, s) for (hq, hkv, d) in heads for tq in tqs for (b, s) in bs
              if b * s * hkv * d * 2 * 2 <= args.max_cache_gb * 2**30]
    out = args.out or (RESULTS_DIR if platform == "gpu" else SMOKE_OUT)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {out}: cannot create the results directory ({e.strerror or e})")
    stem = os.path.join(out, args.name or f"decode-{device.device_kind.replace(' ', '_')}-{meta['date']}")
    t0 = time.perf_counter()
    rows = []
    for i, (hq, hkv, d, tq, b, s) in enumerate(shapes):
        def progress(msg, i=i):
            print(f"[{i + 1}/{len(shapes)} {time.perf_counter() - t0:6.1f} s] {msg}", flush=True)
        rows += rows_for_shape(args, meta, hq, hkv, d, tq, b, s, progress)
        with open(stem + ".json", "w") as f:  # after every shape: a run cut short keeps its rows
            json.dump(dict(meta=dict(meta, shapes_done=i + 1, shapes=len(shapes)), rows=rows), f, indent=1)
    text = markdown(rows, meta)
    with open(stem + ".md", "w") as f:
        f.write(text)
    wrote = [stem + ".json", stem + ".md"]
    if platform == "gpu" and plot(rows, meta, stem + ".png"):
        wrote.append(stem + ".png")
    print(text)
    print("wrote " + ", ".join(wrote), flush=True)
    if rows and all(r["error"] for r in rows):
        print("every row failed (see the error column)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
