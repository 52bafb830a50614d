"""Host cost per call of a jitted attention step, against its pipelined time: for jax_flash and the peers asked for,
the time the Python loop takes to enqueue N calls (host work: JAX dispatch, the runtime, each custom call's handler)
and the time until the last call is done, per call. Where enqueueing costs about as much as the GPU work, the
benchmark's pipelined timings measure the host, not the kernels.

    python tools/dispatch_cost.py --shapes 1x128x1x128,16x1024x16x128c --impls jax_flash,fa3_jax,cudnn
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from timeline_step import attention_fn


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x128x1x128,16x1024x16x128c", help="BxSxHxD[c], comma-separated")
    ap.add_argument("--impls", default="jax_flash,fa3_jax,cudnn")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--samples", type=int, default=7)
    a = ap.parse_args()
    print(f"{'shape':>18} {'impl':>10} {'step':>8} {'enqueue us/call':>16} {'pipelined us/call':>18}")
    for spec in a.shapes.split(","):
        causal = spec.endswith("c")
        b, s, h, d = (int(x) for x in spec.rstrip("c").split("x"))
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v, do = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in keys)
        for impl in a.impls.split(","):
            f = attention_fn(impl, causal)
            steps = {"fwd": (jax.jit(f), (q, k, v)),
                     "fwd+bwd": (jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do)), (q, k, v, do))}
            for name, (step, args) in steps.items():
                try:
                    for _ in range(3):
                        jax.block_until_ready(step(*args))
                    enq, total = [], []
                    for _ in range(a.samples):
                        t0 = time.perf_counter()
                        outs = [step(*args) for _ in range(a.calls)]
                        t1 = time.perf_counter()
                        jax.block_until_ready(outs)
                        t2 = time.perf_counter()
                        enq.append((t1 - t0) / a.calls * 1e6)
                        total.append((t2 - t0) / a.calls * 1e6)
                        del outs
                    print(f"{spec:>18} {impl:>10} {name:>8} {statistics.median(enq):16.1f} "
                          f"{statistics.median(total):18.1f}")
                except Exception as e:  # a peer that does not take this shape
                    print(f"{spec:>18} {impl:>10} {name:>8} error: {type(e).__name__}: {str(e).splitlines()[0][:80]}")


if __name__ == "__main__":
    main()
