"""Small forward+backward calls for compute-sanitizer (memcheck, racecheck): every head-dim class, odd lengths,
Sq != Sk, GQA, and each mask. Run as `compute-sanitizer --tool memcheck python tools/sanitize_small.py`."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, kwargs)
    (1, 17, 97, 2, 1, 64, dict()),
    (2, 97, 33, 4, 2, 128, dict(is_causal=True)),
    (1, 65, 130, 2, 2, 256, dict(local_window_size=(7, 3))),
    (2, 40, 70, 2, 1, 72, dict(query_seq_lengths=np.array([40, 9], np.int32),
                               key_value_seq_lengths=np.array([0, 50], np.int32))),
    (1, 129, 129, 1, 1, 200, dict(is_causal=True, local_window_size=20)),
    # more forward work units than SMs: persistent CTAs take several tiles
    (2, 640, 640, 32, 8, 128, dict(is_causal=True)),
]


def main():
    rng = np.random.default_rng(0)
    for b, sq, sk, hq, hkv, d, kw in CASES:
        for dtype in (jnp.bfloat16, jnp.float16):
            q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype)
            k = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), dtype)
            v = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), dtype)
            f = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, **kw)
            out, vjp = jax.vjp(f, q, k, v)
            grads = vjp(jnp.ones_like(out))
            finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (out, *grads))
            print(f"B={b} Sq={sq} Sk={sk} Hq={hq} Hkv={hkv} D={d} {jnp.dtype(dtype).name} {kw}: finite={finite}",
                  flush=True)


if __name__ == "__main__":
    main()
