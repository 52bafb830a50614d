"""Device time of the XLA work that turns segment ids into the kernels' operands (jax_flash._ffi.segment_runs and
segment_metadata) and of the primitives it is made of, each jitted alone with the ids as an argument, at the packed
benchmark's shape: which piece a training step's packing costs.

    python3 tools/bench_segment_ops.py [--batch 4 --tokens 8192 --docs 8]
"""

import argparse
import os
import runpy
import statistics
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _ffi


def _time(fn, *args, reps=20, samples=7):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out)


def _stages(ids):
    """segment_runs cut after each of its stages (prefixes), to find a slow one."""
    def prefix(stage, x):
        q_stats, kv_stats = _ffi._id_groups(x, x)
        if stage == 0:
            return q_stats, kv_stats
        q = _ffi._runs_from_stats(*q_stats)
        if stage == 1:
            return q
        kv = _ffi._runs_from_stats(*kv_stats)
        if stage == 2:
            return q, kv

        def rising(v):
            return jnp.all(v[:, 1:] >= v[:, :-1], axis=-1)

        exact = (jnp.all(q[2], axis=-1) & jnp.all(kv[2], axis=-1) & rising(q[0]) & rising(q[1]) & rising(kv[0])
                 & rising(kv[1]))
        if stage == 3:
            return exact
        q_lo = q[0].at[:, 0].set(jnp.where(exact, q[0][:, 0], -1))
        if stage == 4:
            return q_lo
        return jnp.stack([q_lo, q[1]], axis=-1), jnp.stack([kv[0], kv[1]], axis=-1)

    return {f"segment_runs to stage {k}": (jax.jit(lambda x, k=k: prefix(k, x)), ids) for k in range(6)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=8)
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    bench = types.SimpleNamespace(**runpy.run_path(os.path.join(here, "..", "benchmarks", "bench_packed.py")))
    ids = jnp.asarray(bench._doc_ids(np.random.default_rng(0), a.batch, a.tokens, a.docs, "equal"))
    both = jnp.concatenate([ids, ids], axis=-1)
    n, w = both.shape
    flat = both.reshape(-1)
    seg = jnp.asarray(np.repeat(np.arange(n * w // 2), 2), jnp.int32)
    perm = jnp.asarray(np.stack([np.random.default_rng(1).permutation(w) for _ in range(n)]), jnp.int32)
    rows = jnp.asarray(np.repeat(np.arange(n), w), jnp.int32)
    pieces = {
        "segment_runs (as built)": (jax.jit(lambda x: _ffi.segment_runs(x, x)), ids),
        "segment_metadata": (jax.jit(lambda x: _ffi.segment_metadata(x, x)), ids),
        "argsort stable [B, 2T]": (jax.jit(lambda x: jnp.argsort(x, axis=-1, stable=True)), both),
        "argsort unstable [B, 2T]": (jax.jit(lambda x: jnp.argsort(x, axis=-1, stable=False)), both),
        "sort [B, 2T]": (jax.jit(lambda x: jnp.sort(x, axis=-1)), both),
        "argsort stable [B, T]": (jax.jit(lambda x: jnp.argsort(x, axis=-1, stable=True)), ids),
        "cumsum [B, 2T]": (jax.jit(lambda x: jnp.cumsum(x, axis=-1)), both),
        "cummax [B, 2T]": (jax.jit(lambda x: jax.lax.cummax(x, axis=1)), both),
        "segment_min (B T segments)": (jax.jit(lambda x, s: jax.ops.segment_min(x, s, n * w // 2,
                                                                                indices_are_sorted=True)), flat, seg),
        "scatter set [B, 2T]": (jax.jit(lambda x, p: jnp.zeros((n, w), jnp.int32).at[rows, p.reshape(-1)].set(
            x, unique_indices=True)), flat, perm),
        "take_along_axis [B, 2T]": (jax.jit(lambda x, p: jnp.take_along_axis(x, p, axis=-1)), both, perm),
    }
    pieces.update(_stages(ids))
    print(f"segment ids [{a.batch}, {a.tokens}], {a.docs} documents per row; {jax.devices()[0].device_kind}")
    for name, (fn, *args) in pieces.items():
        try:
            print(f"{_time(fn, *args) * 1e6:9.1f} us  {name}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"   failed  {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)


if __name__ == "__main__":
    main()
