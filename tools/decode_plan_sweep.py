"""jax_flash.decode_attention's time per call under given split plans (num_splits, balanced or not) beside the plan
decode_split_plan picks, at decode shapes of one's choice, equal and ragged lengths, with bench_decode.py's timing
(chained calls in one program, the GPU's traced span per call). For choosing the plan's rules on a GPU:

    python3 tools/decode_plan_sweep.py --shapes 32/8/128:16:4160 8/1/128:64:8192 --plans 1 2 4b auto [--tq 1]

A shape is Hq/Hkv/D:B:S (dense caches of S keys); a plan is a split count, with `b` for a balanced one, `auto`
(decode_split_plan's choice, shown beside it), or `1len` (equal lengths only: kv_lengths passed as one scalar, the
plan for equal lengths, shown beside it). Prints one line per (shape, lengths, plan) and a table per shape.
"""

import argparse
import os
import runpy
import types

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _ffi


def _bench():
    """benchmarks/bench_decode.py's functions."""
    here = os.path.dirname(os.path.abspath(__file__))
    return types.SimpleNamespace(**runpy.run_path(os.path.join(here, "..", "benchmarks", "bench_decode.py")))


def parse_shape(text):
    heads, b, s = text.split(":")
    hq, hkv, d = (int(x) for x in heads.split("/"))
    return hq, hkv, d, int(b), int(s)


def parse_plan(text, q_shape, hkv, capacity):
    """(label, (num_splits, balance))."""
    if text in ("auto", "1len"):
        plan = _ffi.decode_split_plan(q_shape, hkv, capacity, uniform=text == "1len")
        return f"{text}={plan[0]}{'b' if plan[1] else ''}", plan
    balance = text.endswith("b")
    return text, (int(text.rstrip("b")), balance)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", required=True, help="Hq/Hkv/D:B:S")
    ap.add_argument("--plans", nargs="+", default=["1", "2", "2b", "4b", "auto"])
    ap.add_argument("--tq", type=int, default=1)
    ap.add_argument("--lengths", default="equal,ragged",
                    help="equal, ragged (uniform in [Tq, S], one draw per --seeds value: ragged0, ragged1, ...)")
    ap.add_argument("--seeds", type=int, default=1, help="ragged draws")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    bench = _bench()
    peak = bench.peak_gbps(jax.devices()[0].device_kind)
    for shape in a.shapes:
        hq, hkv, d, b, s = parse_shape(shape)
        kq, kk, kv, kl = jax.random.split(jax.random.PRNGKey(b + s + hq), 4)
        q = jax.random.normal(kq, (b, a.tq, hq, d), jnp.bfloat16)
        k = jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16)
        v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)
        caches = bench._cache_copies(k, v, "device", a.calls)
        table = {}
        kinds = [x for x in a.lengths.split(",") if x == "equal"]
        if "ragged" in a.lengths.split(","):
            kinds += ["ragged"] if a.seeds == 1 else [f"ragged{i}" for i in range(a.seeds)]
        for kind in kinds:
            draw = jax.random.fold_in(kl, int(kind[6:] or 0)) if kind != "equal" else kl
            n = (jnp.full((b,), s, jnp.int32) if kind == "equal"
                 else jax.random.randint(draw, (b,), max(a.tq, 1), s + 1, jnp.int32))
            kv_bytes = int(np.asarray(n, np.int64).sum()) * hkv * d * 2 * 2
            for text in a.plans:
                if text == "1len" and kind != "equal":
                    continue
                label, plan = parse_plan(text, q.shape, hkv, s)
                original = _ffi.decode_split_plan
                _ffi.decode_split_plan = lambda *args, plan=plan, **kw: plan
                try:
                    fn = lambda q, kc, vc, n, t: jax_flash.decode_attention(q, kc, vc, n)  # noqa: E731
                    lens = n[0] if text == "1len" else n  # 1len: one scalar for every sequence
                    us, _ = bench._time_us(fn, q, caches, lens, None, a.calls, a.reps, "device")
                finally:
                    _ffi.decode_split_plan = original
                pct = 100 * kv_bytes / us / 1e3 / peak if peak else float("nan")
                table.setdefault(label, {})[kind] = (us, pct)
                print(f"{shape} Tq {a.tq} {kind:6s} plan {label:8s} {us:8.1f} us ({pct:4.0f} %)", flush=True)
        print(f"\n| {shape} Tq {a.tq} | " + " | ".join(kinds) + " |")
        print("|---|" + "---|" * len(kinds))
        for label, by_kind in table.items():
            cells = [f"{by_kind[k][0]:.1f} us ({by_kind[k][1]:.0f} %)" if k in by_kind else "-" for k in kinds]
            print(f"| {label} | " + " | ".join(cells) + " |")
        print(flush=True)
        del k, v, caches


if __name__ == "__main__":
    main()
