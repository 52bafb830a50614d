"""One packed causal training step (jit of grad, as benchmarks/bench_packed.py times it) for Nsight Compute: every
kernel of the step through tools/kernel_list.sh, or one kernel in depth through tools/ncu_kernel.sh. --impl picks
the row of bench_packed's packed table: `packed` (jax_flash with segment ids), `rows` (the same documents as
separate batch rows), `unpacked` (plain causal over all the tokens) or `cudnn` (jax.nn's cuDNN, unpacked causal).
Runs the step --runs times after compiling it (each run the same kernel sequence); with --trace, traces those runs
with jax.profiler and prints the middle one's GPU activities and the gaps between them (launch gaps and clock
effects that Nsight Compute's serialised kernel durations do not show).

    SCRIPT=tools/profile_packed.py bash tools/kernel_list.sh "packed rows unpacked" --batch 4 --tokens 8192
"""

import argparse
import os
import runpy
import types

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash


def _bench():
    """benchmarks/bench_packed.py's functions (its document ids and training step)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return types.SimpleNamespace(**runpy.run_path(os.path.join(here, "..", "benchmarks", "bench_packed.py")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="packed", choices=("packed", "rows", "unpacked", "cudnn"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--doc-lengths", default="equal", choices=("equal", "random"))
    ap.add_argument("--runs", type=int, default=2, help="runs after the compile")
    ap.add_argument("--trace", action="store_true",
                    help="trace the runs with jax.profiler and print the middle one's GPU activities and gaps "
                         "(tools/timeline_step.py's trace_steps) instead of running them for Nsight Compute")
    a = ap.parse_args()
    bench = _bench()
    b, t, h, d, n = a.batch, a.tokens, a.heads, a.head_dim, a.docs
    rng = np.random.default_rng(0)
    seg = jnp.asarray(bench._doc_ids(rng, b, t, n, a.doc_lengths))
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for _ in range(4))
    if a.impl == "rows" and (a.doc_lengths != "equal" or t % n):
        raise SystemExit("--impl rows needs documents of equal lengths that divide --tokens")
    split = lambda x: x.reshape(b * n, t // n, *x.shape[2:])  # noqa: E731
    attn = {  # each takes the ids as an argument of the step (bench_packed's _train_step), used or not
        "packed": lambda q, k, v, seg: jax_flash.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=seg),
        "rows": lambda q, k, v, seg: jax_flash.dot_product_attention(split(q), split(k), split(v),
                                                                     is_causal=True).reshape(b, t, h, d),
        "unpacked": lambda q, k, v, seg: jax_flash.dot_product_attention(q, k, v, is_causal=True),
        "cudnn": lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
    }[a.impl]
    step = bench._train_step(attn)
    jax.block_until_ready(step(q, k, v, do, seg))
    if a.trace:
        here = os.path.dirname(os.path.abspath(__file__))
        timeline = runpy.run_path(os.path.join(here, "timeline_step.py"))
        timeline["trace_steps"](f"{a.impl} {b} x {t} tokens, {n} documents",
                                lambda: jax.block_until_ready(step(q, k, v, do, seg)), a.runs)
        return
    for _ in range(a.runs):
        jax.block_until_ready(step(q, k, v, do, seg))


if __name__ == "__main__":
    main()
