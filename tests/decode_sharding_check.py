"""decode_attention under sharding, run by tests/test_decode.py in a subprocess (JAX's device count is fixed when it
starts): ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python decode_sharding_check.py CASE...``. A case is
spec:lengths:layout with spec in dp, tp, dp_tp (q and the caches sharded over the batch, the kv heads, or both, on a
("dp", "tp") mesh of 2 x 4 Auto axes), lengths per-sequence or one (kv_lengths of shape ()), layout dense or paged16.
Prints one JSON line per case: {"case", "ok", "error"?, "out_err", "lse_err" (against the unsharded call),
"collectives" (of the compiled call), "out_spec"}."""

import json
import re
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_flash

B, TQ, HQ, HKV, D, CAP, PAGE = 4, 2, 8, 4, 32, 96, 16
SPECS = {"dp": P("dp"), "tp": P(None, None, "tp"), "dp_tp": P("dp", None, "tp")}
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def run_case(spec_name, lengths, layout):
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, TQ, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, CAP, HKV, D)).astype(np.float32) for _ in range(2))
    n = np.array([96, 5, 50, 2], np.int32) if lengths == "per-sequence" else np.int32(50)
    table = None
    if layout == "paged16":  # each sequence's pages in reversed order in one pool
        per = CAP // PAGE
        table = (np.arange(B * per, dtype=np.int32).reshape(B, per))[:, ::-1].copy()
        pool = lambda x: np.concatenate([x[b].reshape(per, PAGE, HKV, D)[::-1] for b in range(B)])  # noqa: E731
        k, v = pool(k), pool(v)
    call = jax.jit(lambda q, k, v, n, t: jax_flash.decode_attention(q, k, v, n, page_table=t, return_residual=True))
    want_o, want_lse = call(q, k, v, n, table)
    spec = SPECS[spec_name]
    q_sharding = NamedSharding(mesh, spec)
    kv_sharding = NamedSharding(mesh, spec if table is None else P(None, None, *spec[2:]))
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged caches on several devices: gathered into dense ones, with a warning
        qs = jax.device_put(q, q_sharding)
        ks, vs = (jax.device_put(x, kv_sharding) for x in (k, v))
        ns = jax.device_put(n, NamedSharding(mesh, P(spec[0]) if n.ndim else P()))
        ts = None if table is None else jax.device_put(table, NamedSharding(mesh, P(spec[0])))
        o, lse = call(qs, ks, vs, ns, ts)
        hlo = call.lower(qs, ks, vs, ns, ts).compile().as_text()
    err = lambda x, r: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(r, np.float64))))  # noqa: E731
    return dict(out_err=err(o, want_o), lse_err=err(lse, want_lse),
                collectives=sorted({c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", hlo)}),
                out_spec=str(o.sharding.spec))


def main(cases):
    assert jax.device_count() >= 8, jax.devices()
    for case in cases:
        try:
            result = dict(case=case, ok=True, **run_case(*case.split(":")))
        except Exception as e:  # noqa: BLE001 - reported to the test
            result = dict(case=case, ok=False, error=f"{type(e).__name__}: {e}"[-2000:],
                          trace=traceback.format_exc()[-3000:])
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
