"""One decode call at a given shape, dense or paged (a pool of pages in shuffled order), by jax_flash or a peer of
benchmarks/bench_decode.py (the same functions), for Nsight Compute: one kernel in depth through
tools/ncu_kernel.sh, or every kernel of a call through tools/kernel_list.sh. Runs the call --runs times after
compiling it (each run's kernels the same sequence, so the last run's can be told from the compile's).

    SCRIPT=tools/profile_decode.py NAME=paged16 bash tools/ncu_kernel.sh flash_decode --tq 16 --page-size 16
"""

import argparse
import os
import runpy
import types

import jax
import jax.numpy as jnp


def _bench():
    """benchmarks/bench_decode.py's functions (its implementations() gives every peer's call)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return types.SimpleNamespace(**runpy.run_path(os.path.join(here, "..", "benchmarks", "bench_decode.py")))


def add_shape_args(ap, tq=16, paged=True):
    """The decode shape's arguments (tools/timeline_decode.py takes them too)."""
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--tq", type=int, default=tq)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    if paged:
        ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--ragged", action="store_true", help="lengths uniform in [Tq, S] (bench_decode's ragged rows)")


def decode_inputs(a):
    """(q, k, v, lengths, page_table) of the shape in `a` (bfloat16; paged: a pool of pages in shuffled order)."""
    kq, kk, kv, kp, kl = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(kq, (a.batch, a.tq, a.heads, a.head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (a.batch, a.seqlen, a.kv_heads, a.head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (a.batch, a.seqlen, a.kv_heads, a.head_dim), jnp.bfloat16)
    n = (jax.random.randint(kl, (a.batch,), a.tq, a.seqlen + 1, jnp.int32) if a.ragged
         else jnp.full((a.batch,), a.seqlen, jnp.int32))
    table = None
    if getattr(a, "page_size", None):  # page j of the pool holds the keys of page order[j] of the dense caches
        pages = a.batch * a.seqlen // a.page_size
        order = jax.random.permutation(kp, pages)
        k, v = (x.reshape(pages, a.page_size, a.kv_heads, a.head_dim)[order] for x in (k, v))
        table = jnp.argsort(order).astype(jnp.int32).reshape(a.batch, -1)
    return q, k, v, n, table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="jax_flash", help="jax_flash, jax_flash_1len (one length; equal lengths only), "
                    "jax_flash_sm80, cudnn, xla, fa3_jax or tokamax")
    add_shape_args(ap)
    ap.add_argument("--runs", type=int, default=2, help="runs after the compile")
    a = ap.parse_args()
    bench = _bench()
    q, k, v, n, table = decode_inputs(a)
    layout = "dense" if a.page_size is None else f"paged{a.page_size}"
    # fa3_jax runs with jax_flash's split count, as in bench_decode (its own default is one split)
    splits = bench._ffi.decode_splits(q.shape, a.kv_heads, a.seqlen, table is not None) if a.impl == "fa3_jax" else None
    fn, why = bench.implementations(a.impl, a.tq, layout, splits, ragged=a.ragged)
    if fn is None:
        raise SystemExit(f"{a.impl} does not run this call: {why}")
    f = jax.jit(fn)
    jax.block_until_ready(f(q, k, v, n, table))
    for _ in range(a.runs):
        jax.block_until_ready(f(q, k, v, n, table))


if __name__ == "__main__":
    main()
