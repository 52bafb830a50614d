"""One decode_attention call at a given shape, dense or paged (a pool of pages in shuffled order), for Nsight
Compute through tools/ncu_kernel.sh:

    SCRIPT=tools/profile_decode.py NAME=paged16 bash tools/ncu_kernel.sh flash_decode --tq 16 --page-size 16
"""

import argparse

import jax
import jax.numpy as jnp

import jax_flash


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--tq", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=None)
    a = ap.parse_args()
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(kq, (a.batch, a.tq, a.heads, a.head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (a.batch, a.seqlen, a.kv_heads, a.head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (a.batch, a.seqlen, a.kv_heads, a.head_dim), jnp.bfloat16)
    n = jnp.full((a.batch,), a.seqlen, jnp.int32)
    table = None
    if a.page_size:  # page j of the pool holds the keys of page order[j] of the dense caches
        pages = a.batch * a.seqlen // a.page_size
        order = jax.random.permutation(kp, pages)
        k, v = (x.reshape(pages, a.page_size, a.kv_heads, a.head_dim)[order] for x in (k, v))
        table = jnp.argsort(order).astype(jnp.int32).reshape(a.batch, -1)
    f = jax.jit(lambda q, k, v, n, t: jax_flash.decode_attention(q, k, v, n, page_table=t))
    jax.block_until_ready(f(q, k, v, n, table))
    jax.block_until_ready(f(q, k, v, n, table))


if __name__ == "__main__":
    main()
