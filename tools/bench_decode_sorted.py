"""benchmarks/bench_decode.py with its ragged lengths sorted longest first (SORTED=1) or as drawn (SORTED=0): the
same lengths, bytes and kernels, so the difference is the order in which the kernel's grid meets the sequences
(how much a ranking of the batch could buy; NOTES, session 73).

    SORTED=1 python3 tools/bench_decode_sorted.py benchmarks/bench_decode.py --preset core --lengths ragged ...
"""
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp

_randint = jax.random.randint


def randint(key, shape, minval, maxval, dtype=jnp.int32):
    n = _randint(key, shape, minval, maxval, dtype)
    return -jnp.sort(-n) if os.environ.get("SORTED") == "1" else n


jax.random.randint = randint
spec = importlib.util.spec_from_file_location("bench_decode", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
raise SystemExit(mod.main(sys.argv[2:]))
