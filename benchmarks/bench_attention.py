"""Attention-only benchmark: jax_flash beside jax.nn.dot_product_attention (xla and cudnn) and the installed JAX
peers (FlashAttention-3 as a JAX op, tokamax) in one process.

Times are medians over samples of back-to-back jit'd calls (wall clock from the first dispatch to block_until_ready
on the last, divided by the number of calls; a sample covers about 20 ms of calls, 4 to 100) after warm-up, so
per-call host synchronisation is not counted; the forward's per-call latency (one call, then block_until_ready) is
reported separately. TFLOP/s use the FlashAttention convention: forward = 4*B*Hq*Sq*Sk*D (halved when causal),
backward = 2.5x forward, with the backward time taken as t(forward+backward) - t(forward). Each row also reports
the relative error of the forward output against a float32 reference computed on a slice of heads.

    python benchmarks/bench_attention.py            # full matrix on a GPU; a smoke run without one
    python benchmarks/bench_attention.py --quick    # a handful of shapes

Implementations (--impls; by default these five, each where it applies):
  jax_flash   jax_flash.dot_product_attention
  cudnn, xla  jax.nn.dot_product_attention(implementation=...)
  fa3_jax     flash_attn3_jax.flash_mha (PyPI flash-attn3-jax; its wheel has head-dim-128 kernels only, so it runs at
              head dim 128 and its cells at other head dims are empty)
  tokamax     tokamax.dot_product_attention(implementation="mosaic") (fails under jax_enable_x64)
A peer that is not installed is skipped with a note saying why (printed and in the table); the GPU-only ones
(cudnn, fa3_jax, tokamax) are skipped without a GPU. ``../shared/peers/fetch_peer_wheels.sh`` downloads the peers'
wheels for a machine without network.

Writes <out>/<device>-<date>.json (one row per shape x implementation), a markdown table with jax_flash/cudnn
ratios (jax_flash/xla where cudnn did not run) (.md) and a plot of TFLOP/s against sequence length (.png). While it
runs, <stem>.partial.json holds the shapes done so far (removed at the end), so a run stopped early can still be
tabulated with --merge. <out> defaults to benchmarks/results/ on a GPU.

Without a GPU the run is a smoke run: two tiny shapes (unless --shapes) through the whole pipeline on the CPU,
jax_flash against xla. Its timings are not performance numbers, and its files go outside the source tree, to
<temp dir>/jax_flash_bench/ (SMOKE_OUT) unless --out says otherwise.
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

IMPLS = ("jax_flash", "cudnn", "xla", "fa3_jax", "tokamax")
GPU_ONLY = ("cudnn", "fa3_jax", "tokamax")
PEERS = ("cudnn", "fa3_jax", "tokamax")  # the best of these is the bar of the "vs best peer" ratios
# jax_flash with one more option, for its cost against the plain call (only through --impls). The values keep the
# output equal to the plain call's within bfloat16 rounding (so the error column stays comparable) and the work the
# same: sinks of -1e4 (weights exp(-1e4 - lse) = 0); a soft cap of 50 (Gemma 2's: c tanh(x / c) moves the unit-scale
# logits of random inputs by under 1e-2), which the sm_90a forward takes with a fixed exponent reference as it does
# every cap up to 56.8; a soft cap of 1e4 (c tanh(x / c) = x to float32 rounding), past that bound: a running max.
VARIANTS = {"jax_flash+sinks": dict(sinks=-1e4), "jax_flash+softcap": dict(logits_soft_cap=50.0),
            "jax_flash+softcap1e4": dict(logits_soft_cap=1e4)}
ALL_IMPLS = IMPLS + tuple(VARIANTS)
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # default --out on a GPU
SMOKE_OUT = os.path.join(tempfile.gettempdir(), "jax_flash_bench")  # default --out without one
TOKENS = 16384
MODEL_WIDTH = 2048  # heads = MODEL_WIDTH // head_dim


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seqlen: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool

    @property
    def label(self):
        heads = f"{self.heads_q}" if self.heads_q == self.heads_kv else f"{self.heads_q}q/{self.heads_kv}kv"
        return f"{self.batch}x{self.seqlen}x{heads}x{self.head_dim}{' causal' if self.causal else ''}"

    def fwd_flops(self):
        f = 4.0 * self.batch * self.heads_q * self.seqlen * self.seqlen * self.head_dim
        return f / 2 if self.causal else f


def shape_matrix(quick, on_gpu):
    if not on_gpu:
        return [Shape(1, 256, 4, 4, 64, c) for c in (False, True)]
    if quick:
        return [
            Shape(1, 1024, 16, 16, 64, False),
            Shape(4, 4096, 16, 16, 128, False),
            Shape(4, 4096, 16, 16, 128, True),
            Shape(1, 16384, 16, 16, 128, False),
            Shape(2, 4096, 32, 8, 128, True),
            Shape(4, 4096, 8, 8, 256, False),
        ]
    shapes = []
    for d in (64, 128, 256):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            for c in (False, True):
                shapes.append(Shape(TOKENS // s, s, MODEL_WIDTH // d, MODEL_WIDTH // d, d, c))
    for s in (4096, 8192):
        for c in (False, True):
            shapes.append(Shape(TOKENS // s, s, 32, 8, 128, c))
    shapes += [Shape(1, 512, 8, 8, 64, False), Shape(1, 1024, 16, 16, 64, False)]
    return shapes


def parse_shapes(spec):
    """'4x4096x16x128,2x4096x32/8x128c' -> Shapes (B x S x Hq[/Hkv] x D, a trailing 'c' for causal)."""
    shapes = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        causal = item.endswith("c")
        try:
            b, s, h, d = item.rstrip("c").split("x")
            hq, _, hkv = h.partition("/")
            shape = Shape(int(b), int(s), int(hq), int(hkv or hq), int(d), causal)
            if min(shape.batch, shape.seqlen, shape.heads_q, shape.heads_kv, shape.head_dim) < 1:
                raise ValueError
            shapes.append(shape)
        except ValueError:
            raise SystemExit(f"--shapes: cannot read {item!r}; expected BxSxHq[/Hkv]xD[c] of positive integers, "
                             "e.g. 2x4096x32/8x128c")
    if not shapes:
        raise SystemExit(f"--shapes: no shape in {spec!r}")
    return shapes


def attention_fn(impl, causal, deterministic=False):
    if impl == "jax_flash" or impl in VARIANTS:
        options = dict(VARIANTS.get(impl, {}))
        if "sinks" in options:
            def with_sinks(q, k, v):
                sinks = jnp.full((q.shape[2],), options["sinks"], jnp.float32)
                return jax_flash.dot_product_attention(q, k, v, is_causal=causal, deterministic=deterministic,
                                                       sinks=sinks)
            return with_sinks
        return lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal,
                                                               deterministic=deterministic, **options)
    if impl == "fa3_jax":
        import flash_attn3_jax
        return lambda q, k, v: flash_attn3_jax.flash_mha(q, k, v, is_causal=causal)
    if impl == "tokamax":
        import tokamax
        return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic")
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def missing_peer(impl):
    """Why `impl` (fa3_jax or tokamax) cannot run here: None if its package imports."""
    module = {"fa3_jax": "flash_attn3_jax", "tokamax": "tokamax"}.get(impl)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is not usable
        return f"not installed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


def applies(impl, shape):
    """Whether `impl` has kernels for `shape` (FA3-jax's wheel: head dim 128 only)."""
    return impl != "fa3_jax" or shape.head_dim == 128


# Back-to-back calls per sample: enough to cover this much device time, and never fewer than MIN_REPS, so no call
# waits on the host between dispatches. A sample pays once for filling and draining the pipeline (about one call's
# latency minus its device time: 100-200 µs on an H200), so it must be long against that: 2 ms samples made
# 16 x 1024 x 16 x 128 causal read a forward of 0.199 ms for two implementations whose kernels take 154 and 160 µs,
# and a 0.96x backward ratio where the device timeline gives 0.985x (NOTES, session 35).
SAMPLE_SECONDS = 20e-3
MIN_REPS = 4
MAX_REPS = 100


def time_fn(fn, args, warmup, iters, min_time):
    """(median seconds per call over pipelined samples, median latency of one blocking call)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    latencies = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        latencies.append(time.perf_counter() - t0)
    latency = statistics.median(latencies)
    reps = max(MIN_REPS, min(MAX_REPS, int(SAMPLE_SECONDS / latency)))
    times = []
    start = time.perf_counter()
    while len(times) < iters or (time.perf_counter() - start < min_time and len(times) < 10 * iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times), latency


def reference_error(out, q, k, v, causal, max_heads):
    """||out - ref|| / ||ref|| over the first query heads (ref in float32 through jax.nn's xla path)."""
    hq, hkv = q.shape[2], k.shape[2]
    group = hq // hkv
    nq = min(hq, max(group, max_heads // group * group))
    nkv = max(1, nq // group)
    f32 = lambda x: x.astype(jnp.float32)
    ref = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"))(
        f32(q[:, :, :nq]), f32(k[:, :, :nkv]), f32(v[:, :, :nkv]))
    diff = f32(out[:, :, :nq]) - ref
    return float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref))


def run_case(shape, impl, dtype, args):
    key = jax.random.PRNGKey(0)
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (shape.batch, shape.seqlen, shape.heads_q, shape.head_dim), dtype)
    k = jax.random.normal(kk, (shape.batch, shape.seqlen, shape.heads_kv, shape.head_dim), dtype)
    v = jax.random.normal(kv, (shape.batch, shape.seqlen, shape.heads_kv, shape.head_dim), dtype)
    do = jax.random.normal(kd, q.shape, dtype)
    f = attention_fn(impl, shape.causal, args.deterministic)
    fwd = jax.jit(f)
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
    row = dict(impl=impl, B=shape.batch, Sq=shape.seqlen, Sk=shape.seqlen, Hq=shape.heads_q, Hkv=shape.heads_kv,
               D=shape.head_dim, causal=shape.causal, dtype=jnp.dtype(dtype).name, fwd_ms=None, bwd_ms=None,
               fwd_tflops=None, bwd_tflops=None, fwd_latency_ms=None, rel_err=None, error=None)
    try:
        out = jax.block_until_ready(fwd(q, k, v))
        t_f, lat = time_fn(fwd, (q, k, v), args.warmup, args.iters, args.min_time)
        row.update(fwd_ms=t_f * 1e3, fwd_tflops=shape.fwd_flops() / t_f / 1e12, fwd_latency_ms=lat * 1e3)
        row["rel_err"] = reference_error(out, q, k, v, shape.causal, args.ref_heads)
        del out
        if args.fwd_only:
            return row
        t_fb, _ = time_fn(fwd_bwd, (q, k, v, do), args.warmup, args.iters, args.min_time)
        t_b = max(t_fb - t_f, 1e-9)
        row.update(bwd_ms=t_b * 1e3, bwd_tflops=2.5 * shape.fwd_flops() / t_b / 1e12)
    except Exception as e:  # an implementation that refuses or runs out of memory on a shape
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def fmt(x, spec=".0f"):
    return "–" if x is None else format(x, spec)


def fmt_rate(x):
    """TFLOP/s: whole numbers from 10 up, three significant digits below (a CPU smoke run's are far below 1)."""
    return fmt(x, ".0f" if x is None or x >= 10 else ".3g")


def default_out(platform):
    return RESULTS_DIR if platform == "gpu" else SMOKE_OUT


def markdown(rows, meta):
    by = {}
    for r in rows:
        by.setdefault((r["B"], r["Sq"], r["Hq"], r["Hkv"], r["D"], r["causal"]), {})[r["impl"]] = r
    impls = [i for i in ALL_IMPLS if any(r["impl"] == i for r in rows)]
    baseline = next((i for i in ("cudnn", "xla") if i in impls and "jax_flash" in impls), None)  # of the ratios
    peers = [i for i in PEERS if i in impls and "jax_flash" in impls]
    skipped = meta.get("skipped") or {}
    lines = [f"# Attention benchmark: {meta['device']}, jax {meta['jax_version']}, {meta['date']}", "",
             ("Smoke run without a GPU: the timings are not performance numbers. " if meta.get("smoke") else "") +
             (f"Partial run: {meta['partial']}. " if meta.get("partial") else "") +
             ("jax_flash with deterministic=True; " if meta.get("deterministic") else "") +
             f"dtype {meta['dtype']}; fwd / bwd TFLOP/s (fwd ms, pipelined; fwd latency ms of one blocking call); " +
             (f"ratio = jax_flash / {baseline}" if baseline else "no ratios") +
             ("; vs best = jax_flash / the fastest of " + ", ".join(peers) + " on that shape (which one)"
              if peers else "") + "; err = forward relative error vs float32."]
    if skipped:
        lines += ["", "Not run: " + "; ".join(f"{i}: {why}" for i, why in skipped.items()) + "."]
    if "fa3_jax" in impls:
        lines += ["", "fa3_jax runs at head dim 128 only (its wheel's kernels); its other cells are empty."]
    lines += ["", "| B, S, Hq/Hkv, D, causal | " + " | ".join(impls) + " | fwd ratio | bwd ratio" +
              (" | fwd vs best | bwd vs best" if peers else "") + " | jax_flash err |",
              "|---|" + "---|" * (len(impls) + 3 + (2 if peers else 0))]
    ratios = {k: [] for k in ("fwd", "bwd", "fwd_best", "bwd_best")}
    for (b, s, hq, hkv, d, c), group in by.items():
        cells = []
        for i in impls:
            r = group.get(i)
            if r is None or r["error"]:
                cells.append("error" if r else "–")
            else:
                cells.append(f"{fmt_rate(r['fwd_tflops'])} / {fmt_rate(r['bwd_tflops'])} "
                             f"({fmt(r['fwd_ms'], '.3f')}; {fmt(r['fwd_latency_ms'], '.3f')})")
        jf = group.get("jax_flash")
        ok = lambda r, key: r is not None and not r["error"] and r[key]
        row_ratios = {}
        for key in ("fwd", "bwd"):
            rate = f"{key}_tflops"
            base = group.get(baseline)
            if ok(jf, rate) and ok(base, rate):
                row_ratios[key] = jf[rate] / base[rate]
            best = max((group[i] for i in peers if ok(group.get(i), rate)), key=lambda r: r[rate], default=None)
            if ok(jf, rate) and best is not None:
                row_ratios[f"{key}_best"] = (jf[rate] / best[rate], best["impl"])
        for key, value in row_ratios.items():
            ratios[key].append(value[0] if isinstance(value, tuple) else value)
        best_cells = ""
        if peers:
            best_cells = "".join(f" | {fmt(row_ratios[k][0], '.2f')} ({row_ratios[k][1]})" if k in row_ratios
                                 else " | –" for k in ("fwd_best", "bwd_best"))
        err = fmt(jf["rel_err"], ".1e") if jf else "–"
        lines.append(f"| {b}, {s}, {hq}/{hkv}, {d}, {'Y' if c else 'N'} | " + " | ".join(cells) +
                     f" | {fmt(row_ratios.get('fwd'), '.2f')} | {fmt(row_ratios.get('bwd'), '.2f')}" + best_cells +
                     f" | {err} |")
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None
    if baseline:
        lines += ["", f"Geometric mean jax_flash/{baseline}: forward {fmt(gm(ratios['fwd']), '.2f')}, "
                      f"backward {fmt(gm(ratios['bwd']), '.2f')}."]
    else:
        lines += ["", "No ratios: jax_flash did not run beside cudnn or xla (--impls)."]
    if peers:
        lines += [f"jax_flash / best peer: forward geometric mean {fmt(gm(ratios['fwd_best']), '.2f')} (min "
                  f"{fmt(min(ratios['fwd_best'], default=None), '.2f')}), backward {fmt(gm(ratios['bwd_best']), '.2f')}"
                  f" (min {fmt(min(ratios['bwd_best'], default=None), '.2f')})."]
    return "\n".join(lines) + "\n"


def plot_rows(rows):
    """The rows the plot shows (the matrix's fixed-token MHA shapes that ran) and its panels: the (head dim, causal)
    pairs among them, in order."""
    mha = [r for r in rows if r["Hq"] == r["Hkv"] and r["B"] * r["Sq"] == TOKENS and not r["error"]]
    return mha, sorted({(r["D"], r["causal"]) for r in mha})


def plot(rows, meta, path):
    """Plots TFLOP/s against sequence length for the matrix's fixed-token MHA shapes, a column per (head dim,
    causal) pair with data; False if there are none or matplotlib (the `bench` extra) is missing."""
    mha, panels = plot_rows(rows)
    if not panels:
        return False
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install '.[bench]' in the repository)", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 8), squeeze=False)
    for col, (d, causal) in enumerate(panels):
        for row_i, key in enumerate(("fwd_tflops", "bwd_tflops")):
            ax = axes[row_i][col]
            for impl in ALL_IMPLS:
                pts = sorted((r["Sq"], r[key]) for r in mha
                             if r["impl"] == impl and r["D"] == d and r["causal"] == causal and r[key])
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{'forward' if row_i == 0 else 'backward'}, d={d}{', causal' if causal else ''}")
            ax.set_xlabel("sequence length (batch x seq = 16k)")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(f"{meta['device']}, jax {meta['jax_version']}, {meta['dtype']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def warm_up_device(seconds=2.0):
    """Keeps the device busy with matrix products for a moment, so that the first case does not run at idle clocks."""
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    step = jax.jit(lambda x: (x @ x) * (1.0 / 4096))
    jax.block_until_ready(step(x))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            x = step(x)
        jax.block_until_ready(x)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a handful of shapes")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help="comma-separated subset of " + ",".join(ALL_IMPLS) + " (the last two: jax_flash with "
                             "sinks or a soft cap, for their cost); peers not installed are skipped with a note")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--out", default=None,
                        help=f"results directory (default: benchmarks/results/ on a GPU; without one, for a smoke "
                             f"run, {SMOKE_OUT}, outside the source tree)")
    parser.add_argument("--name", default=None, help="file stem (default <device>-<date>)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--min-time", type=float, default=0.3, help="keep timing until this many seconds")
    parser.add_argument("--ref-heads", type=int, default=2, help="query heads checked against the reference")
    parser.add_argument("--deterministic", action="store_true",
                        help="run jax_flash with deterministic=True (bitwise-reproducible backward)")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shapes BxSxHq[/Hkv]xD[c] instead of the built-in matrix")
    parser.add_argument("--fwd-only", action="store_true", help="time the forward only")
    parser.add_argument("--head-dims", default=None, help="comma-separated head dims: run only those shapes")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="run nothing: write the table and plot of these result files (parts of one run)")
    args = parser.parse_args(argv)

    if args.merge:
        parts = []
        for path in args.merge:
            try:
                with open(path) as f:
                    parts.append(json.load(f))
            except (OSError, ValueError) as e:
                parser.error(f"--merge: cannot read {path}: {e}")
        runs = {(p["meta"]["device"], p["meta"]["jax_version"], p["meta"]["dtype"]) for p in parts}
        if len(runs) > 1:
            parser.error(f"--merge: parts of different runs (device, jax version, dtype): {sorted(runs)}")
        # one file: a stopped run's partial results, labelled so; several: the parts of one run, whole together
        meta = parts[0]["meta"] if len(parts) == 1 else {k: v for k, v in parts[0]["meta"].items() if k != "partial"}
        rows = [r for part in parts for r in part["rows"]]
        out = args.out or default_out(meta["platform"])
        return write_results(rows, meta, os.path.join(out, args.name or
                                                      f"{meta['device'].replace(' ', '_')}-{meta['date']}"))

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    out = args.out or default_out(device.platform)
    try:  # before any measurement, not after
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {out}: cannot create the results directory ({e.strerror or e})")
    impls = [i for i in args.impls.split(",") if i]
    unknown = [i for i in impls if i not in ALL_IMPLS]
    if unknown:
        parser.error(f"--impls: unknown {', '.join(unknown)}; choose from {', '.join(ALL_IMPLS)}")
    skipped = {}
    for i in impls:
        why = "GPU only" if i in GPU_ONLY and not on_gpu else missing_peer(i)
        if why:
            skipped[i] = why
            print(f"{i}: {why}; skipped", flush=True)
    impls = [i for i in impls if i not in skipped]
    if not impls:
        parser.error(f"--impls: nothing left to run here ({'; '.join(f'{i}: {w}' for i, w in skipped.items())})")
    if args.iters < 1 or args.warmup < 0:
        parser.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    dtype = jnp.dtype(args.dtype)
    date = datetime.date.today().isoformat()
    meta = dict(device=device.device_kind, platform=device.platform, jax_version=jax.__version__,
                jax_flash_version=jax_flash.__version__, date=date,
                dtype=dtype.name, deterministic=args.deterministic, smoke=not on_gpu, skipped=skipped,
                method="median over samples of back-to-back jit'd calls (wall clock to "
                "block_until_ready on the last) per call; latency = median of single blocking calls")
    shapes = parse_shapes(args.shapes) if args.shapes else shape_matrix(args.quick, on_gpu)
    if args.head_dims:
        try:
            dims = {int(d) for d in args.head_dims.split(",")}
        except ValueError:
            parser.error(f"--head-dims: comma-separated integers, e.g. 64,128; got {args.head_dims!r}")
        shapes = [sh for sh in shapes if sh.head_dim in dims]
        if not shapes:
            parser.error(f"--head-dims {args.head_dims}: no shape of the matrix has those head dims")
    rows = []
    stem = os.path.join(out, args.name or f"{meta['device'].replace(' ', '_')}-{date}")
    print(f"{meta['device']} | jax {jax.__version__} | {len(shapes)} shapes x {impls}", flush=True)
    if not on_gpu:
        print(f"No GPU: a smoke run of the benchmark on the {device.platform.upper()}; its timings are not "
              f"performance numbers. Results go to {out}.", flush=True)
    if on_gpu:
        warm_up_device()
    for n, shape in enumerate(shapes, 1):
        for impl in (i for i in impls if applies(i, shape)):
            t0 = time.perf_counter()
            row = run_case(shape, impl, dtype, args)
            row.update(device=meta["device"], jax_version=jax.__version__, date=date)
            rows.append(row)
            status = row["error"] or (f"fwd {fmt_rate(row['fwd_tflops'])} TFLOP/s ({fmt(row['fwd_ms'], '.3f')} "
                                      f"ms, latency {fmt(row['fwd_latency_ms'], '.3f')} ms), "
                                      f"bwd {fmt_rate(row['bwd_tflops'])} TFLOP/s, err {fmt(row['rel_err'], '.1e')}")
            print(f"[{n}/{len(shapes)}] {shape.label:<28} {impl:<9} {status}  ({time.perf_counter() - t0:.0f}s)",
                  flush=True)
        write_partial(rows, meta, stem, n, len(shapes))
    status = write_results(rows, meta, stem)
    os.remove(stem + ".partial.json")
    if rows and all(r["error"] for r in rows):
        print("every row failed (see the error column)", file=sys.stderr)
        return 1
    return status


def write_partial(rows, meta, stem, done, total):
    """Writes <stem>.partial.json after each shape, so a run stopped early (a time limit, a crash) keeps what it
    measured: `--merge <stem>.partial.json` tabulates it. The complete run removes it."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".partial.json.tmp", "w") as f:
        json.dump(dict(meta=dict(meta, partial=f"{done} of {total} shapes"), rows=rows), f, indent=1)
    os.replace(stem + ".partial.json.tmp", stem + ".partial.json")


def write_results(rows, meta, stem):
    """Writes <stem>.json, .md and .png and prints the table."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    md = markdown(rows, meta)
    with open(stem + ".md", "w") as f:
        f.write(md)
    plotted = plot(rows, meta, stem + ".png")
    print(md)
    print(f"wrote {stem}.json, {stem}.md" + (f", {stem}.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
