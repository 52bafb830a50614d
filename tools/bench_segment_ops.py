"""Time per call of the target that turns segment ids into the kernels' operands (jax_flash._ffi.segment_operands:
chunk metadata and runs), jitted alone with the ids as an argument as in a training step, on the packed benchmark's
shapes and a few harder ones: what a training step's packing costs before the attention kernels start. Wall time
per call, so a floor of the dispatch (~10-20 us on a GPU); the kernel list of the packed step has the device time.

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=8)
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    bench = types.SimpleNamespace(**runpy.run_path(os.path.join(here, "..", "benchmarks", "bench_packed.py")))
    rng = np.random.default_rng(0)

    def ids(batch, tokens, docs, lengths="equal"):
        return jnp.asarray(bench._doc_ids(rng, batch, tokens, docs, lengths))

    op = jax.jit(lambda q, kv: _ffi.segment_operands(q, kv))
    cases = {
        f"[{a.batch}, {a.tokens}], {a.docs} equal documents": (ids(a.batch, a.tokens, a.docs),) * 2,
        f"[{a.batch}, {a.tokens}], {a.docs} random-length documents": (ids(a.batch, a.tokens, a.docs, "random"),) * 2,
        f"[{a.batch}, {a.tokens}], 2000 documents (runs limit {_ffi.MAX_SEGMENT_RUNS})": (
            ids(a.batch, a.tokens, 2000),) * 2,
        f"[{a.batch}, {a.tokens}], random ids (not runs)": (
            jnp.asarray(rng.integers(0, 8, (a.batch, a.tokens)), jnp.int32),) * 2,
        "[1, 131072], 64 documents": (ids(1, 131072, 64),) * 2,
        "[32, 1024], 1 document": (ids(32, 1024, 1),) * 2,
    }
    print(f"segment_operands (metadata + runs), ids an argument of the jitted call; {jax.devices()[0].device_kind}")
    for name, args in cases.items():
        print(f"{_time(op, *args) * 1e6:9.1f} us  {name}", flush=True)


if __name__ == "__main__":
    main()
