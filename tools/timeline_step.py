"""The GPU timeline of a jitted attention step (forward + backward by vjp, or forward alone), from jax.profiler's
CUPTI trace: for jax_flash and each peer asked for, every GPU activity of one step in order with its duration and
the idle gap before it, and per implementation the step's span against the sum of its activities. Shows time that
kernel-level profiles (Nsight Compute) miss: launch gaps, small XLA kernels, memsets, copies.

    python tools/timeline_step.py --batch 16 --seqlen 1024 --heads 16 --head-dim 128 --causal --impls jax_flash,fa3_jax
    python tools/timeline_step.py --batch 2 --seqlen 8192 --heads 32 --kv-heads 8 --causal   # GQA
"""

import argparse
import glob
import gzip
import json
import os
import tempfile

import jax
import jax.numpy as jnp

import jax_flash


def attention_fn(impl, causal):
    if impl == "fa3_jax":
        import flash_attn3_jax
        return lambda q, k, v: flash_attn3_jax.flash_mha(q, k, v, is_causal=causal)
    if impl == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    return lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal)


def gpu_events(trace_dir):
    """The trace's complete events on GPU streams, sorted by start: (ts us, dur us, name)."""
    path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "/device:GPU" in str(e.get("args", {}).get("name", ""))}
    out = [(float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", "?")) for e in events
           if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    return sorted(out)


def trace_steps(label, run_step, steps):
    """Traces `steps` calls of run_step() (each waits for its step: the host's waits separate the steps) with
    jax.profiler and prints the middle step's GPU activities, each with the idle gap before it, and every step's
    span. Steps of equal activity counts are told apart by count, otherwise at the steps - 1 largest gaps."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                run_step()
        events = gpu_events(d)
    if not events:
        print(f"{label}: no GPU events in the trace (CUPTI unavailable?)")
        return
    per = len(events) // steps
    if per * steps == len(events):
        pieces = [events[i * per:(i + 1) * per] for i in range(steps)]
    else:
        gaps = [(events[i][0] - (events[i - 1][0] + events[i - 1][1]), i) for i in range(1, len(events))]
        cuts = sorted(i for _, i in sorted(gaps, reverse=True)[:steps - 1])
        pieces = [events[s:e] for s, e in zip([0] + cuts, cuts + [len(events)])]
    spans = [p[-1][0] + p[-1][1] - p[0][0] for p in pieces]
    mid = pieces[len(pieces) // 2]
    busy = sum(dur for _, dur, _ in mid)
    print(f"\n{label}: {len(events)} GPU events in {steps} steps; step spans (us) "
          f"{', '.join(f'{s:.1f}' for s in spans)}; middle step: {len(mid)} events, busy {busy:.1f} us, "
          f"idle inside {spans[len(pieces) // 2] - busy:.1f} us")
    prev_end = None
    for ts, dur, name in mid:
        gap = 0.0 if prev_end is None else ts - prev_end
        print(f"  gap {gap:7.1f}  dur {dur:8.1f}  {name[:110]}")
        prev_end = ts + dur


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA; default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--impls", default="jax_flash,fa3_jax")
    ap.add_argument("--steps", type=int, default=5, help="steps traced (the middle one is shown)")
    ap.add_argument("--forward-only", action="store_true")
    a = ap.parse_args()
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    kv_heads = a.kv_heads or a.heads
    if a.heads % kv_heads:
        ap.error(f"--heads {a.heads} is not a multiple of --kv-heads {kv_heads}")
    q = jax.random.normal(kq, (a.batch, a.seqlen, a.heads, a.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (a.batch, a.seqlen, kv_heads, a.head_dim), jnp.bfloat16) for key in (kk, kv))
    for impl in a.impls.split(","):
        f = attention_fn(impl, a.causal)
        if a.forward_only:
            step = jax.jit(f)
        else:
            step = jax.jit(lambda q, k, v, f=f: jax.vjp(f, q, k, v)[1](jnp.ones_like(q)))
        jax.block_until_ready(step(q, k, v))
        jax.block_until_ready(step(q, k, v))
        trace_steps(impl, lambda: jax.block_until_ready(step(q, k, v)), a.steps)


if __name__ == "__main__":
    main()
