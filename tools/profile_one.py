"""One forward+backward call at a given shape, for `ncu --clock-control none -k regex:flash_ ...`: jax_flash's, or
a peer's to compare with (--impl fa3_jax: flash_attn3_jax.flash_mha; cudnn: jax.nn's cuDNN path).

    python tools/profile_one.py --batch 4 --seqlen 4096 --heads 16 --head-dim 128 [--causal] [--impl fa3_jax]
"""

import argparse

import jax
import jax.numpy as jnp

import jax_flash


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--impl", default="jax_flash", choices=("jax_flash", "fa3_jax", "cudnn"))
    ap.add_argument("--softcap", type=float, default=None, help="jax_flash's logits_soft_cap")
    a = ap.parse_args()
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    hkv = a.kv_heads or a.heads
    q = jax.random.normal(kq, (a.batch, a.seqlen, a.heads, a.head_dim), a.dtype)
    k = jax.random.normal(kk, (a.batch, a.seqlen, hkv, a.head_dim), a.dtype)
    v = jax.random.normal(kv, (a.batch, a.seqlen, hkv, a.head_dim), a.dtype)
    if a.impl == "fa3_jax":
        import flash_attn3_jax
        f = lambda q, k, v: flash_attn3_jax.flash_mha(q, k, v, is_causal=a.causal)
    elif a.impl == "cudnn":
        f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=a.causal, implementation="cudnn")
    else:
        f = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=a.causal, logits_soft_cap=a.softcap)
    step = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](jnp.ones_like(q)))
    jax.block_until_ready(step(q, k, v))


if __name__ == "__main__":
    main()
