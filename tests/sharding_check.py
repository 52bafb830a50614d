"""Multi-device checks of jax_flash under sharding, run by tests/test_sharding.py in a subprocess (JAX's device
count is fixed when it starts): ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python sharding_check.py``.
Prints one JSON line per case: {"case", "ok", "error"?, "fwd_err", "grad_err", "fwd_ref_err", "grad_ref_err",
"base_fwd_ref_err", "base_grad_ref_err", "fwd_collectives", "grad_collectives", "out_spec"}: *_err against the
unsharded call, *_ref_err of the sharded call and base_*_ref_err of the unsharded one against the float64 reference
(relative to the reference's largest magnitude, the worst of dq, dk, dv for the gradients).

Environment: JAX_FLASH_CHECK_MESH (default "2x4") is the ("dp", "tp") mesh shape over the first devices,
JAX_FLASH_CHECK_DTYPE (default "float32") the inputs' dtype (bfloat16 on GPUs).

Cases "decode:spec:lengths:layout" (run by tests/test_decode.py) shard a decode_attention call over the batch, the
kv heads or both (spec dp, tp, dp_tp; Auto axes), with per-sequence lengths or one length (kv_lengths of shape ()),
dense or paged16 caches, on Auto axes or (a fifth field) Explicit ones: {"case", "ok", "out_err", "lse_err"
(against the unsharded call), "collectives", "out_spec"}. Cases "sinks:axis_type:spec:mode" take the gradient of
a call with sinks with respect to q and the sinks (on the mesh, or inside the user's shard_map): {"case", "ok",
"dq_err", "dsinks_err", "dsinks_spec"}. Cases "mixed:spec" run on a mesh of an Explicit and an Auto axis: {"case",
"ok", "out_err", "grad_err", "warned"}."""

import contextlib
import json
import os
import re
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_flash
from jax_flash.reference import numpy_attention_fwd_bwd, visible_mask

B, T, D = 4, 64, 32
MESH = tuple(int(n) for n in os.environ.get("JAX_FLASH_CHECK_MESH", "2x4").split("x"))
DTYPE = jnp.dtype(os.environ.get("JAX_FLASH_CHECK_DTYPE", "float32"))
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")

SPECS = {
    "dp": P("dp"),
    "tp": P(None, None, "tp"),
    "dp_tp": P("dp", None, "tp"),
    "repl": P(),
    "sp": P(None, "tp"),
    "dp_sp": P("dp", "tp"),
    "hd": P(None, None, None, "tp"),  # head_dim sharded: gathered
}
MASKS = {
    "none": dict(),
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(7, 3)),
    "causal_window_lens": dict(is_causal=True, local_window_size=(9, 0), lens=True),
    "lens": dict(lens=True),
    # segment ids (packed, a different packing per batch row), sinks and a soft cap, causal
    "options": dict(is_causal=True, options=True),
}


def collectives(hlo):
    """{name: count} of the collectives in compiled HLO text (the -start of async pairs counted once)."""
    counts = {}
    for name in COLLECTIVES:
        n = len(re.findall(rf" {name}(?:-start)?\(", hlo))  # the opcode (operands read "%all-gather.3")
        if n:
            counts[name] = n
    return counts


def gathered_operands(hlo):
    """Shapes gathered by the all-gathers of compiled HLO text."""
    return re.findall(r"^\s*\S+ = (.*?) all-gather(?:-start)?\(", hlo, re.M)


def run_case(axis_type, spec_name, hq, hkv, mask_name, vmap=False, remat=False, in_shard_map=False,
             set_mesh=True):
    mesh = jax.make_mesh(MESH, ("dp", "tp"), axis_types=(axis_type,) * 2,
                         devices=jax.devices()[:MESH[0] * MESH[1]])
    spec = SPECS[spec_name]
    kw = dict(MASKS[mask_name])
    lens = kw.pop("lens", False)
    options = kw.pop("options", False)
    rng = np.random.default_rng(0)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(shape, np.float32), DTYPE)
                   for shape in ((B, T, hq, D), (B, T, hkv, D), (B, T, hkv, D), (B, T, hq, D)))
    ids = sinks = cap = None
    if options:
        ids = np.stack([np.searchsorted(np.sort(rng.choice(np.arange(1, T), 2 + b, replace=False)), np.arange(T),
                                        side="right") for b in range(B)]).astype(np.int32)
        sinks = rng.standard_normal(hq).astype(np.float32)
        cap = 5.0
        kw.update(q_segment_ids=jnp.asarray(ids), sinks=jnp.asarray(sinks), logits_soft_cap=cap)
    q_lens = np.array([T, 0, 1, 37], np.int32) if lens else None
    kv_lens = np.array([50, 5, 0, T], np.int32) if lens else None

    def attn(q, k, v):
        return jax_flash.dot_product_attention(q, k, v, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
                                               **kw)

    f = attn
    if in_shard_map:  # the user's own shard_map: the kernel runs on each block (lengths: none with a sharded batch)
        kv_spec = P(*[None if (i == 2 and hkv % MESH[1]) else e for i, e in enumerate(list(spec) + [None] * 3)][:3])
        f = jax.shard_map(attn, mesh=mesh, in_specs=(spec, kv_spec, kv_spec), out_specs=spec)
    if remat:
        f = jax.checkpoint(f)
    if vmap:  # vmap over a leading axis of 1 (the mesh shards the dims after it)
        inner = f
        f = lambda q, k, v: jax.vmap(inner)(q[None], k[None], v[None])[0]  # noqa: E731

    def loss(q, k, v):
        return jnp.sum((f(q, k, v) * ct).astype(jnp.float32))

    fwd, grad = jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    ref_o = np.asarray(jax.jit(attn)(q, k, v))
    ref_g = [np.asarray(x) for x in jax.jit(jax.grad(lambda q, k, v: jnp.sum((attn(q, k, v) * ct).astype(
        jnp.float32)), argnums=(0, 1, 2)))(q, k, v)]
    visible = visible_mask(T, T, is_causal=kw.get("is_causal", False), local_window_size=kw.get("local_window_size"),
                           query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens, q_segment_ids=ids,
                           kv_segment_ids=ids)
    ref64 = numpy_attention_fwd_bwd(q, k, v, ct, visible, sinks=sinks, logits_soft_cap=cap)[:4]
    q_sharding = NamedSharding(mesh, spec)
    kv_spec = list(spec) + [None] * (4 - len(spec))
    if hkv % MESH[1]:  # one kv head (or a count the head axis does not divide): K and V replicated over the heads
        kv_spec[2] = None
    kv_sharding = NamedSharding(mesh, P(*kv_spec))
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():  # nomesh: sharded arrays only
        qs = jax.device_put(q, q_sharding)
        ks, vs = (jax.device_put(x, kv_sharding) for x in (k, v))
        o = fwd(qs, ks, vs)
        g = grad(qs, ks, vs)
        fwd_hlo = fwd.lower(qs, ks, vs).compile().as_text()
        grad_hlo = grad.lower(qs, ks, vs).compile().as_text()
    def err(x, r):
        return float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(r, np.float64))))

    def ref_err(outs):  # relative to the reference's largest magnitude; gradients: the worst of dq, dk, dv
        rel = [err(x, r) / max(float(np.max(np.abs(r))), 1e-30) for x, r in zip(outs, ref64)]
        return rel[0], max(rel[1:])

    fwd_ref_err, grad_ref_err = ref_err([o, *g])
    base_fwd_ref_err, base_grad_ref_err = ref_err([ref_o, *ref_g])
    return dict(
        fwd_err=err(o, ref_o),
        grad_err=max(err(a, b) for a, b in zip(g, ref_g)),
        fwd_ref_err=fwd_ref_err, grad_ref_err=grad_ref_err, base_fwd_ref_err=base_fwd_ref_err,
        base_grad_ref_err=base_grad_ref_err,
        fwd_collectives=collectives(fwd_hlo),
        grad_collectives=collectives(grad_hlo),
        fwd_gathered=gathered_operands(fwd_hlo),
        out_spec=str(o.sharding.spec) if isinstance(o.sharding, NamedSharding) else str(o.sharding),
        want_spec=str(spec),
    )


def run_sinks_case(axis_type, spec_name, mode):
    """The gradient of a call with sinks with respect to q and the sinks, q, k and v sharded by `spec_name` and the
    sinks an array on the mesh (replicated; mode "mesh") or the call inside the user's jax.shard_map (mode
    "shardmap"; the sinks replicated there), against the unsharded call: the sinks' cotangent must come back typed
    as the sinks."""
    mesh = jax.make_mesh(MESH, ("dp", "tp"), axis_types=(axis_type,) * 2, devices=jax.devices()[:MESH[0] * MESH[1]])
    spec = SPECS[spec_name]
    kv_spec = P(*(list(spec) + [None] * 3)[:3])
    rng = np.random.default_rng(1)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(shape, np.float32), DTYPE)
                   for shape in ((B, T, 8, D), (B, T, 4, D), (B, T, 4, D), (B, T, 8, D)))
    sinks = jnp.asarray(rng.standard_normal(8), jnp.float32)

    def attn(q, k, v, s):
        return jax_flash.dot_product_attention(q, k, v, sinks=s, is_causal=True)

    f = attn
    if mode == "shardmap":
        f = jax.shard_map(attn, mesh=mesh, in_specs=(spec, kv_spec, kv_spec, P()), out_specs=spec)

    def grads(f, *args):
        return jax.jit(jax.grad(lambda q, k, v, s: jnp.sum((f(q, k, v, s) * ct).astype(jnp.float32)),
                                argnums=(0, 3)))(*args)

    want_dq, want_ds = grads(attn, q, k, v, sinks)
    with jax.set_mesh(mesh):
        dq, ds = grads(f, jax.device_put(q, NamedSharding(mesh, spec)),
                       *(jax.device_put(x, NamedSharding(mesh, kv_spec)) for x in (k, v)),
                       jax.device_put(sinks, NamedSharding(mesh, P())))
    err = lambda x, r: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(r, np.float64))))  # noqa: E731
    return dict(dq_err=err(dq, want_dq), dsinks_err=err(ds, want_ds), dsinks_spec=str(ds.sharding.spec))


def run_mixed_case(spec_name):
    """A call on a mesh of an Explicit "dp" and an Auto "tp" axis, q, k and v sharded by `spec_name`: the values and
    gradients of the unsharded call, and one warning that the Auto axes are not partitioned."""
    mesh = jax.make_mesh(MESH, ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto),
                         devices=jax.devices()[:MESH[0] * MESH[1]])
    spec = SPECS[spec_name]
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), DTYPE)
               for shape in ((B, T, 8, D), (B, T, 4, D), (B, T, 4, D)))

    def loss(q, k, v):
        return jnp.sum(jax_flash.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32) ** 2)

    fwd = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    want_o, want_g = fwd(q, k, v), grad(q, k, v)
    with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        o, g = fwd(*args), grad(*args)
    err = lambda x, r: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(r, np.float64))))  # noqa: E731
    return dict(out_err=err(o, want_o), grad_err=max(err(a, b) for a, b in zip(g, want_g)),
                warned=sum("mixing Explicit and Auto" in str(w.message) for w in caught))


def run_decode_case(spec_name, lengths, layout, axis_type="Auto"):
    """One decode_attention call sharded by `spec_name` against the same call unsharded (B 4, Tq 2, Hq 8, Hkv 4)."""
    mesh = jax.make_mesh(MESH, ("dp", "tp"), axis_types=(getattr(AxisType, axis_type),) * 2,
                         devices=jax.devices()[:MESH[0] * MESH[1]])
    b, tq, hq, hkv, cap, page = 4, 2, 8, 4, 96, 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, tq, hq, D), np.float32), DTYPE)
    k, v = (jnp.asarray(rng.standard_normal((b, cap, hkv, D), np.float32), DTYPE) for _ in range(2))
    n = np.array([96, 5, 50, 2], np.int32) if lengths == "per-sequence" else np.int32(50)
    table = None
    if layout == "paged16":  # each sequence's pages in reversed order, in one pool
        per = cap // page
        table = np.arange(b * per, dtype=np.int32).reshape(b, per)[:, ::-1].copy()
        k, v = (x.reshape(b, per, page, hkv, D)[:, ::-1].reshape(b * per, page, hkv, D) for x in (k, v))
    call = jax.jit(lambda q, k, v, n, t: jax_flash.decode_attention(q, k, v, n, page_table=t, return_residual=True))
    want_o, want_lse = call(q, k, v, n, table)
    spec = SPECS[spec_name]
    kv_spec = spec if table is None else P(None, None, *spec[2:])  # a page pool is not split by batch
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged caches on several devices: gathered into dense ones, with a warning
        args = (jax.device_put(q, NamedSharding(mesh, spec)),
                *(jax.device_put(x, NamedSharding(mesh, kv_spec)) for x in (k, v)),
                jax.device_put(n, NamedSharding(mesh, P(spec[0]) if n.ndim else P())),
                None if table is None else jax.device_put(table, NamedSharding(mesh, P(spec[0]))))
        o, lse = call(*args)
        hlo = call.lower(*args).compile().as_text()
    err = lambda x, r: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(r, np.float64))))  # noqa: E731
    return dict(out_err=err(o, want_o), lse_err=err(lse, want_lse), collectives=collectives(hlo),
                out_spec=str(o.sharding.spec))


def main(cases):
    assert jax.device_count() >= MESH[0] * MESH[1], (MESH, jax.devices())
    for case in cases:
        kind, *fields = case.split(":")
        try:
            if kind == "decode":
                result = dict(case=case, ok=True, **run_decode_case(*fields))
            elif kind == "mixed":
                result = dict(case=case, ok=True, **run_mixed_case(*fields))
            elif kind == "sinks":
                axis_type, spec_name, mode = fields
                result = dict(case=case, ok=True, **run_sinks_case(getattr(AxisType, axis_type), spec_name, mode))
            else:
                spec_name, hq, hkv, mask_name, *flags = fields
                args = (getattr(AxisType, kind), spec_name, int(hq), int(hkv), mask_name)
                result = dict(case=case, ok=True, **run_case(*args, vmap="vmap" in flags, remat="remat" in flags,
                                                                 in_shard_map="shardmap" in flags,
                                                                 set_mesh="nomesh" not in flags))
        except Exception as e:  # noqa: BLE001 - reported to the test
            result = dict(case=case, ok=False, error=f"{type(e).__name__}: {e}"[-2000:],  # the cause ends the message
                          trace=traceback.format_exc()[-3000:])
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
