"""Quick kernel diagnostics: forward and gradient errors of jax_flash against a float32 reference, beside
jax.nn.dot_product_attention's own error in the same dtype, over masks, lengths, GQA and head dims. Prints one
line per case; exits non-zero when jax_flash's error exceeds 3x jax.nn's (plus a small floor) or is not finite.

    python tools/check_kernels.py
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash.reference import reference_attention

CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, kwargs)
    (2, 128, 128, 2, 2, 64, {}),
    (2, 256, 256, 4, 4, 128, {}),
    (1, 256, 256, 2, 2, 256, {}),
    (1, 17, 97, 4, 1, 64, {}),
    (1, 97, 17, 4, 2, 128, dict(is_causal=True)),
    (2, 1000, 1000, 2, 2, 128, dict(is_causal=True)),
    (1, 300, 500, 8, 2, 72, dict(local_window_size=(40, 7))),
    (1, 200, 200, 2, 2, 200, dict(is_causal=True, local_window_size=33)),
    (3, 130, 190, 2, 1, 128, dict(query_seq_lengths=[130, 60, 0], key_value_seq_lengths=[190, 1, 77])),
    (1, 1, 1, 1, 1, 64, {}),
    (1, 513, 513, 2, 2, 256, dict(is_causal=True)),
]


def rel(a, b):
    """||a - b|| / ||b||, with ||b|| floored at 1e-3 per element of unit-scale data (a gradient that is exactly 0 in
    exact arithmetic, e.g. dq for a single key, comes out as rounding noise)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-3 * np.sqrt(b.size)))


def main():
    rng = np.random.default_rng(1)
    failures = 0
    for b, sq, sk, hq, hkv, d, kw in CASES:
        kw = dict(kw)
        for name in ("query_seq_lengths", "key_value_seq_lengths"):
            if name in kw:
                kw[name] = jnp.asarray(kw[name], jnp.int32)
        for dtype in (jnp.bfloat16, jnp.float16):
            q32 = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
            k32 = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
            v32 = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
            do32 = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
            q, k, v, do = (jnp.asarray(x, dtype) for x in (q32, k32, v32, do32))
            up = lambda x: jnp.asarray(x, jnp.float32)

            def run(fn, *args):
                out, vjp = jax.vjp(fn, *args)
                return (out, *vjp(jnp.asarray(do, args[0].dtype)))

            ref = run(lambda q, k, v: reference_attention(q, k, v, **kw), up(q), up(k), up(v))
            try:
                ours = run(jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, **kw)), q, k, v)
                ours = [np.asarray(up(x)) for x in ours]
            except Exception as e:  # report and go on to the next case
                failures += 1
                print(f"FAIL B={b} Sq={sq} Sk={sk} H={hq}/{hkv} D={d} {jnp.dtype(dtype).name}: "
                      f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            errs = [rel(o, r) for o, r in zip(ours, ref)]
            finite = all(bool(jnp.isfinite(up(x)).all()) for x in ours)
            masked_rows = "query_seq_lengths" in kw or "key_value_seq_lengths" in kw
            if masked_rows:  # jax.nn differs on rows that see no key: judge against bf16 rounding alone
                base = [2e-2] * 4
            else:
                theirs = run(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw), q, k, v)
                base = [rel(o, r) for o, r in zip(theirs, ref)]
            ok = finite and all(e <= 3 * bl + 1e-3 for e, bl in zip(errs, base))
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} B={b} Sq={sq} Sk={sk} H={hq}/{hkv} D={d} {jnp.dtype(dtype).name:8} "
                  f"{kw if not masked_rows else 'lengths'}: err o/dq/dk/dv = "
                  + "/".join(f"{e:.1e}" for e in errs) + "  jax.nn: " + "/".join(f"{e:.1e}" for e in base),
                  flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
