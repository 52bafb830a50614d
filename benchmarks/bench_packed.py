"""Packed sequences, sinks and soft-capping: what each costs in jax_flash, beside the peers, in one run.

Rows (forward + backward of sum(o * do), medians; FlashAttention FLOP convention over the pairs that are actually
visible, so a packed run and an unpacked one are comparable per useful FLOP):
  * packed causal training: B x T tokens made of D documents (segment ids; equal lengths, then random lengths
    of at least a quarter of the mean), jax_flash with segment ids; the same batch unpacked (plain causal over T,
    what a user pays without segment ids); jax.nn cuDNN and xla with the equivalent dense mask (their only way to
    express packing);
  * the plain kernel against the kernel with sinks and with a soft cap (and tokamax's ``logits_soft_cap`` where it
    is installed and runs), at one shape, causal and not.

Writes <out>/<name>.json (rows + meta: device, jax version, date) and <name>.md (the tables), and prints progress.
    python3 benchmarks/bench_packed.py [--out DIR] [--tokens 8192] [--docs 8] [--batch 4]
Without a GPU the run is a smoke run: tiny sizes (unless given) through the whole pipeline on the CPU kernels,
its files in <temp dir>/jax_flash_bench/ (SMOKE_OUT) unless --out says otherwise; its timings are not performance
numbers.
"""

import argparse
import datetime
import json
import os
import runpy
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash


# bench_attention.py's functions: its pipelined timer, smoke-run directory and rate format.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ATTENTION = types.SimpleNamespace(**runpy.run_path(os.path.join(_HERE, "bench_attention.py")))
SMOKE_OUT = _ATTENTION.SMOKE_OUT  # default --out without a GPU
# Sizes: a GPU run's, and a smoke run's (no GPU) where the command line gives none.
GPU_SIZES = dict(batch=4, tokens=8192, docs=8, heads=16, head_dim=128, mod_shape="4x4096x16x128", iters=10,
                 min_time=0.3, rounds=3)
SMOKE_SIZES = dict(batch=1, tokens=64, docs=4, heads=2, head_dim=64, mod_shape="1x64x2x64", iters=2, min_time=0.0,
                   rounds=1)


def _time(fn, args, iters, min_time):
    """(median seconds per call over pipelined samples, median latency of one blocking call) after two warm-up
    calls: bench_attention.py's time_fn. A pipelined sample dispatches the call back to back (as a training loop
    does) and synchronises once, so it holds the device time of each call without the host round trip that the
    blocking latency adds; the tables' times and speed-ups are the pipelined ones."""
    return _ATTENTION.time_fn(fn, args, 2, iters, min_time)


def _train_step(attn):
    """jit(grad) of sum(attn(q, k, v, *rest) * do) w.r.t. q, k, v: one forward and one backward. rest (the segment
    ids) are arguments of the step, as in a training loop where every batch brings its own packing, so the work
    that derives the kernels' operands from them is timed too (as closure constants XLA would fold it away)."""
    def loss(q, k, v, do, *rest):
        return jnp.sum(attn(q, k, v, *rest).astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _doc_ids(rng, batch, tokens, docs, lengths):
    """int32 [batch, tokens]: `docs` documents per row, of equal lengths or of random lengths (at least 1/4 of the
    mean each)."""
    rows = []
    for _ in range(batch):
        share = np.full(docs, 1 / docs) if lengths == "equal" else rng.dirichlet(np.ones(docs)) * 0.75 + 0.25 / docs
        ends = np.round(np.cumsum(share) * tokens).astype(int)
        rows.append(np.searchsorted(ends, np.arange(tokens), side="right"))
    return np.stack(rows).astype(np.int32)


def packed_rows(args, rng, progress, lengths):
    b, t, h, d = args.batch, args.tokens, args.heads, args.head_dim
    ids = _doc_ids(rng, b, t, args.docs, lengths)
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for _ in range(4))
    seg = jnp.asarray(ids)
    causal_pairs = b * t * (t + 1) / 2
    same = ids[:, :, None] == ids[:, None, :]
    packed_pairs = float(np.tril(same).sum())
    tril = jnp.asarray(np.tril(np.ones((t, t), bool)))

    def dense_mask(seg):  # [B, 1, T, T], built in the step from the ids as a user of jax.nn would
        return ((seg[:, :, None] == seg[:, None, :]) & tril)[:, None]

    # Every function takes the ids (traced, see _train_step), the ones that do not need them too.
    runs = {
        "jax_flash packed (segment ids)": (lambda q, k, v, seg: jax_flash.dot_product_attention(
            q, k, v, is_causal=True, q_segment_ids=seg), packed_pairs),
        "jax_flash unpacked causal": (lambda q, k, v, seg: jax_flash.dot_product_attention(q, k, v, is_causal=True),
                                      causal_pairs),
        "cudnn dense mask": (lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, mask=dense_mask(seg),
                                                                                implementation="cudnn"),
                             packed_pairs),
        "cudnn unpacked causal": (lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                     implementation="cudnn"),
                                  causal_pairs),
    }
    if lengths == "equal":  # (the same cost either way; it needs B x H x T x T float32 logits)
        runs["xla dense mask"] = (lambda q, k, v, seg: jax.nn.dot_product_attention(
            q, k, v, mask=dense_mask(seg), implementation="xla"), packed_pairs)
    rows = []
    if lengths == "equal":  # the same documents as separate batch rows: the ceiling for packing's efficiency
        n = args.docs
        split = lambda x: x.reshape(b * n, t // n, *x.shape[2:])  # noqa: E731
        runs[f"jax_flash {b * n} x {t // n} causal (documents as rows)"] = (
            lambda q, k, v, seg: jax_flash.dot_product_attention(split(q), split(k), split(v),
                                                                 is_causal=True).reshape(b, t, h, d),
            b * n * (t // n) * (t // n + 1) / 2)
    for name, (attn, pairs) in runs.items():
        if name.split()[0] not in args.impls.split(","):
            continue
        progress(f"packed ({lengths} lengths): {name}")
        row = dict(table="packed", impl=name, batch=b, tokens=t, heads=h, head_dim=d, docs=args.docs,
                   doc_lengths=lengths, visible_pairs=pairs, visible_fraction_of_causal=pairs / causal_pairs)
        try:
            sec, latency = _time(_train_step(attn), (q, k, v, do, seg), args.iters, args.min_time)
            fwd_sec, _ = _time(jax.jit(attn), (q, k, v, seg), args.iters, args.min_time)
            row.update(ms=sec * 1e3, latency_ms=latency * 1e3, fwd_ms=fwd_sec * 1e3,
                       tflops=3.5 * 4 * h * d * pairs / sec / 1e12)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this is a result too
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
    return rows


def _tokamax_softcap(cap, causal):
    try:
        import tokamax
    except Exception as e:  # noqa: BLE001
        return None, f"tokamax not importable: {type(e).__name__}: {e}"

    def attn(q, k, v):
        return tokamax.dot_product_attention(q, k, v, is_causal=causal, logits_soft_cap=cap,
                                             implementation="mosaic")
    return attn, None


def modifier_rows(args, rng, progress):
    b, t, h, d = (int(x) for x in args.mod_shape.split("x"))
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for _ in range(4))
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    rows = []
    for causal in (False, True):
        pairs = b * t * (t + 1) / 2 if causal else b * t * t
        runs = {
            "jax_flash": lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal),
            "jax_flash + sinks": lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal,
                                                                                 sinks=sinks),
            "jax_flash + soft cap 50": lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal,
                                                                                       logits_soft_cap=50.0),
        }
        tok, why = _tokamax_softcap(50.0, causal)
        runs["tokamax + soft cap 50"] = tok
        table = {name: dict(table="modifiers", impl=name, batch=b, tokens=t, heads=h, head_dim=d, causal=causal)
                 for name in runs}
        # Rounds over every implementation in turn, keeping each one's best median: one slow stretch of the GPU
        # (clocks, another implementation's leftovers) does not land on one implementation alone.
        for rnd in range(args.rounds):
            for name, attn in runs.items():
                row = table[name]
                if "error" in row:
                    continue
                if attn is None:
                    row["error"] = why
                    continue
                progress(f"modifiers: {name} causal={causal} round {rnd + 1}/{args.rounds}")
                try:
                    fwd_ms = _time(jax.jit(attn), (q, k, v), args.iters, args.min_time)[0] * 1e3
                    train_ms = _time(_train_step(attn), (q, k, v, do), args.iters, args.min_time)[0] * 1e3
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    continue
                row["fwd_ms"] = min(row.get("fwd_ms", fwd_ms), fwd_ms)
                row["train_ms"] = min(row.get("train_ms", train_ms), train_ms)
                row["fwd_tflops"] = 4 * h * d * pairs / (row["fwd_ms"] / 1e3) / 1e12
                row["bwd_ms"] = row["train_ms"] - row["fwd_ms"]
        rows += table.values()
    for causal in (False, True):  # relative to the plain kernel of the same run
        plain = next(r for r in rows if r["impl"] == "jax_flash" and r["causal"] == causal)
        for r in rows:
            if r["causal"] == causal and "fwd_ms" in r and "fwd_ms" in plain:
                r["fwd_vs_plain"] = r["fwd_ms"] / plain["fwd_ms"]
                r["bwd_vs_plain"] = r["bwd_ms"] / plain["bwd_ms"]
    return rows


def markdown(rows, meta):
    lines = [f"# Packed sequences, sinks, soft-capping: {meta['device']}, jax {meta['jax_version']}, {meta['date']}",
             "", ("Smoke run without a GPU: the timings are not performance numbers. " if meta.get("smoke") else "") +
             "Forward + backward of sum(o * do) (jit of grad), bf16, medians of pipelined samples (calls back to "
             "back, one synchronisation; latency: one blocking call, host round trip included). TFLOP/s over the "
             "visible pairs only (FlashAttention convention: 4 H D per pair forward, x 3.5 forward + backward). "
             "Modifiers: the best median of several rounds over the implementations; bwd = (fwd + bwd) - fwd.", ""]
    for lengths in ("equal", "random"):
        packed = [r for r in rows if r["table"] == "packed" and r["doc_lengths"] == lengths]
        if not packed:
            continue
        r0 = packed[0]
        lines += [f"## Packed causal training: {r0['batch']} x {r0['tokens']} tokens, {r0['docs']} documents of "
                  f"{lengths} lengths per row, {r0['heads']} heads, d{r0['head_dim']}", "",
                  f"The visible area is {r0['visible_fraction_of_causal']:.3f} of the unpacked causal one (ideal "
                  f"speed-up {1 / r0['visible_fraction_of_causal']:.1f}x).", "",
                  "| impl | fwd + bwd ms | TFLOP/s (visible) | time vs jax_flash packed | fwd ms | latency ms |",
                  "|---|---:|---:|---:|---:|---:|"]
        base = packed[0].get("ms")
        for r in packed:
            if "ms" in r:
                vs = f"{r['ms'] / base:.2f}x" if base else ""
                rate = _ATTENTION.fmt_rate(r["tflops"])
                lines.append(f"| {r['impl']} | {r['ms']:.3f} | {rate} | {vs} | {r['fwd_ms']:.3f} | "
                             f"{r['latency_ms']:.3f} |")
            else:
                lines.append(f"| {r['impl']} | error: {r['error']} | | | | |")
        lines.append("")
    mods = [r for r in rows if r["table"] == "modifiers"]
    if mods:
        m0 = mods[0]
        lines += [f"## Sinks and soft cap against the plain kernel: {m0['batch']} x {m0['tokens']} x {m0['heads']} x "
                  f"{m0['head_dim']}", "",
                  "| impl | causal | fwd ms | fwd TFLOP/s | fwd vs plain | bwd ms | bwd vs plain |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in mods:
            if "fwd_ms" in r:
                rate = _ATTENTION.fmt_rate(r["fwd_tflops"])
                lines.append(f"| {r['impl']} | {r['causal']} | {r['fwd_ms']:.3f} | {rate} | "
                             f"{r.get('fwd_vs_plain', float('nan')):.3f} | {r['bwd_ms']:.3f} | "
                             f"{r.get('bwd_vs_plain', float('nan')):.3f} |")
            else:
                lines.append(f"| {r['impl']} | {r['causal']} | error: {r['error']} | | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help=f"results directory (default: benchmarks/results/ on a GPU; without one {SMOKE_OUT})")
    parser.add_argument("--name", default=None, help="file stem (default packed-<device>-<date>)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--docs", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--mod-shape", help="modifiers table: BxTxHxD (default 4x4096x16x128 on a GPU)")
    parser.add_argument("--iters", type=int)
    parser.add_argument("--min-time", type=float)
    parser.add_argument("--rounds", type=int, help="modifiers table: rounds over the implementations")
    parser.add_argument("--tables", default="packed,modifiers")
    parser.add_argument("--doc-lengths", default="equal,random",
                        help="packed table: documents of equal or random lengths (equal,random: both tables)")
    parser.add_argument("--impls", default="jax_flash,cudnn,xla",
                        help="packed table: the implementations whose rows run (comma-separated)")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    for key, value in (GPU_SIZES if on_gpu else SMOKE_SIZES).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = _ATTENTION.default_out(device.platform)
    tables = args.tables.split(",")
    doc_lengths = args.doc_lengths.split(",")
    impls = args.impls.split(",")
    for name, values, allowed in (("--tables", tables, ("packed", "modifiers")),
                                  ("--doc-lengths", doc_lengths, ("equal", "random")),
                                  ("--impls", impls, ("jax_flash", "cudnn", "xla"))):
        bad = [x for x in values if x not in allowed]
        if bad or not values:
            parser.error(f"{name}: unknown {bad}; choose from {list(allowed)} (comma-separated)")
    try:
        mod_shape = [int(x) for x in args.mod_shape.split("x")]
        if len(mod_shape) != 4 or min(mod_shape) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--mod-shape: BxTxHxD of positive integers, e.g. 4x4096x16x128; got {args.mod_shape!r}")
    for name in ("batch", "tokens", "docs", "heads", "head_dim", "iters", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if "packed" in tables and "equal" in doc_lengths and args.tokens % args.docs:
        parser.error(f"--tokens ({args.tokens}) must be a multiple of --docs ({args.docs}) for documents of equal "
                     "lengths")
    try:  # before any measurement, not after
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: cannot create the results directory ({e.strerror or e})")
    if not on_gpu:
        print(f"No GPU: a smoke run on the {device.platform.upper()} (timings are not performance numbers), "
              f"results in {args.out}", flush=True)
    meta = dict(device=device.device_kind, platform=device.platform, jax_version=jax.__version__,
                jax_flash_version=jax_flash.__version__, date=datetime.date.today().isoformat(),
                smoke=not on_gpu)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    progress = lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)  # noqa: E731
    rows = []
    if "packed" in tables:
        for lengths in doc_lengths:
            rows += packed_rows(args, rng, progress, lengths)
    if "modifiers" in tables:
        rows += modifier_rows(args, rng, progress)
    stem = os.path.join(args.out, args.name or f"packed-{device.device_kind.replace(' ', '_')}-{meta['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    text = markdown(rows, meta)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    if rows and all(r.get("error") for r in rows):
        print("every row failed (see the tables)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
