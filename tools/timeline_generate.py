"""Where a LLaMA generation step's time goes for each attention choice: examples/llama_block.py's --mode generate
model (random weights), prefilled with jax_flash, then `--steps` greedy decode steps traced under JAX's profiler
(CUPTI); prints per attention the GPU time of one step by kernel name (count and microseconds per step, largest
first) and the step's span, so that two choices' steps can be compared kernel by kernel.

    python3 tools/timeline_generate.py --batch 64 --seq 2048 --attention jax_flash cudnn [--steps 5 --top 25]
"""

import argparse
import collections
import os
import runpy
import types

import jax
import jax.numpy as jnp
from flax import nnx


def _load(rel):
    here = os.path.dirname(os.path.abspath(__file__))
    return types.SimpleNamespace(**runpy.run_path(os.path.join(here, "..", rel)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=5, help="decode steps traced")
    ap.add_argument("--attention", nargs="+", default=["jax_flash", "cudnn"])
    ap.add_argument("--top", type=int, default=25, help="kernel names listed per attention")
    a = ap.parse_args()
    llama = _load("examples/llama_block.py")
    bench = _load("benchmarks/bench_decode.py")
    cfg = llama.CONFIGS[a.config]
    model = llama.Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (a.batch, a.seq), 0, cfg.vocab, jnp.int32)
    llama.set_attention(model, "jax_flash")
    _, state = nnx.split(model)
    prefill = llama.prefill_fn(model)  # the example's own prefill and decode step

    per_step = {}
    for attention in a.attention:
        llama.set_attention(model, attention)
        step = llama.decode_step_fn(model)
        caches = model.init_caches(a.batch, a.seq + a.steps + 3)
        token, caches = prefill(state, tokens, caches)
        for _ in range(2):  # compile and warm up
            token, caches = step(state, token, caches)
        jax.block_until_ready(token)
        box = [token, caches]

        def work():
            for _ in range(a.steps):
                box[0], box[1] = step(state, box[0], box[1])
                jax.block_until_ready(box[0])

        events = bench.traced_gpu_events(work)
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for s, e, name in events:
            by_name[name][0] += 1
            by_name[name][1] += (e - s) / 1e3
        busy = sum(v[1] for v in by_name.values()) / a.steps
        span = (events[-1][1] - events[0][0]) / 1e3 / a.steps if events else 0.0
        per_step[attention] = {n: (c / a.steps, us / a.steps) for n, (c, us) in by_name.items()}
        print(f"## {attention}: {len(events) / a.steps:.0f} GPU events a step, busy {busy:.1f} us a step "
              f"(trace span / steps {span:.1f} us, host waits between steps included)")
        for name, (count, us) in sorted(per_step[attention].items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"  {count:6.1f} x {us / max(count, 1e-9):8.2f} us = {us:9.1f} us  {name[:110]}")
        del caches, box
    if len(per_step) == 2:
        (na, pa), (nb, pb) = per_step.items()
        print(f"## by name: {na} minus {nb}, us a step (names in one only marked)")
        rows = []
        for name in set(pa) | set(pb):
            ua, ub = pa.get(name, (0, 0.0))[1], pb.get(name, (0, 0.0))[1]
            rows.append((ua - ub, name, name in pa and name in pb))
        for diff, name, both in sorted(rows, key=lambda r: -abs(r[0]))[:a.top]:
            print(f"  {diff:+9.1f} us  {'' if both else '[only one] '}{name[:110]}")


if __name__ == "__main__":
    main()
