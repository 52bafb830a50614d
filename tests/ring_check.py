"""Multi-device checks of jax_flash.ring_attention, run by tests/test_ring.py in a subprocess with 8 fake CPU devices
(JAX fixes its device count when it starts) or on GPUs. Prints one JSON object: {case name: "ok" or an error message}.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python ring_check.py [case ...]
Environment: JAX_FLASH_CHECK_MESH (default "2x4") is the ("dp", "cp") mesh shape over the first devices,
JAX_FLASH_CHECK_DTYPE (default "float32") the inputs' dtype. In float32 the ring is compared with the unsharded call
(TOL); in a 16-bit dtype, its error against the float64 reference may be at most LOW_FACTOR x the unsharded call's
plus LOW_FLOOR (relative to the reference's largest magnitude).
"""

import json
import os
import re
import sys
import traceback

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_flash  # noqa: E402
from jax_flash.reference import numpy_attention_fwd_bwd, visible_mask  # noqa: E402

B, S, HQ, HKV, D = 2, 64, 4, 2, 32
DP, CP = (int(n) for n in os.environ.get("JAX_FLASH_CHECK_MESH", "2x4").split("x"))
DTYPE = jnp.dtype(os.environ.get("JAX_FLASH_CHECK_DTYPE", "float32"))
TOL = 2e-5
LOW_FACTOR, LOW_FLOOR = 2.0, 2.0**-9

MASKS = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(9, 5)),
    "causal_window": dict(is_causal=True, local_window_size=(20, 0)),
    "padded": dict(is_causal=True, lens=((64, 37), (50, 23))),
    "padded_full": dict(lens=((0, 45), (1, 64))),
}


def _mesh():
    devices = np.array(jax.devices()[:DP * CP]).reshape(DP, CP)
    return jax.sharding.Mesh(devices, ("dp", "cp"))


def _shard_map(f, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _inputs(seed):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s), DTYPE)
            for s in ((B, S, HQ, D), (B, S, HKV, D), (B, S, HKV, D), (B, S, HQ, D))]


def _close(name, x, ref, tol=TOL):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert x.shape == ref.shape, (name, x.shape, ref.shape)
    err = np.abs(x - ref).max()
    bound = tol * max(np.abs(ref).max(), 1)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def _close_to_reference(name, x, ref64, base):
    """In float32, x against the unsharded call `base`; in 16 bits, x's error against the float64 reference at most
    LOW_FACTOR x base's plus LOW_FLOOR (relative to the reference's largest magnitude)."""
    if DTYPE == jnp.float32:
        return _close(name, x, base)
    x, ref64, base = (np.asarray(a, np.float64) for a in (x, ref64, base))
    scale = max(np.abs(ref64).max(), 1e-30)
    err, base_err = np.abs(x - ref64).max() / scale, np.abs(base - ref64).max() / scale
    bound = LOW_FACTOR * base_err + LOW_FLOOR
    assert err <= bound, f"{name}: relative error {err:.3g} > {bound:.3g} (unsharded: {base_err:.3g})"


def _reference64(q, k, v, do, kw):
    """float64 (out, dq, dk, dv) of the mask in kw (dot_product_attention's keyword arguments)."""
    visible = visible_mask(S, S, is_causal=kw.get("is_causal", False), local_window_size=kw.get("local_window_size"),
                           query_seq_lengths=kw.get("query_seq_lengths"),
                           key_value_seq_lengths=kw.get("key_value_seq_lengths"))
    return numpy_attention_fwd_bwd(q, k, v, do, visible)


def _kwargs(mask):
    kw = dict(MASKS[mask])
    lens = kw.pop("lens", None)
    if lens is not None:
        kw["query_seq_lengths"] = jnp.asarray(lens[0], jnp.int32)
        kw["key_value_seq_lengths"] = jnp.asarray(lens[1], jnp.int32)
    return kw


def _reference(q, k, v, do, kw):
    """Unsharded jax_flash.dot_product_attention: output and (dq, dk, dv) of sum(o * do)."""
    def loss(q, k, v):
        o = jax_flash.dot_product_attention(q, k, v, **kw)
        return jnp.sum((o * do).astype(jnp.float32)), o
    (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return o, grads


def check_ring(layout, mask, explicit):
    """ring_attention under an explicit shard_map (explicit=True) or through ring_attention_sharded."""
    mesh = _mesh()
    q, k, v, do = _inputs(hash((layout, mask)) % 1000)
    kw = _kwargs(mask)
    ref_o, ref_grads = _reference(q, k, v, do, kw)
    ref64 = _reference64(q, k, v, do, kw)
    order = (lambda x: jax_flash.zigzag_order(x, CP)) if layout == "zigzag" else (lambda x: x)
    restore = (lambda x: jax_flash.zigzag_restore(x, CP)) if layout == "zigzag" else (lambda x: x)
    q_lens, kv_lens = kw.pop("query_seq_lengths", None), kw.pop("key_value_seq_lengths", None)
    if q_lens is None:
        q_lens = kv_lens = jnp.full((B,), S, jnp.int32)

    if explicit:
        spec = P("dp", "cp")

        def body(q, k, v, ql, kl):
            return jax_flash.ring_attention(q, k, v, axis_name="cp", layout=layout, query_seq_lengths=ql,
                                            key_value_seq_lengths=kl, **kw)
        ring = _shard_map(body, mesh, (spec, spec, spec, P("dp"), P("dp")), spec)
    else:
        def ring(q, k, v, ql, kl):
            return jax_flash.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="cp", batch_axis="dp",
                                                    layout=layout, query_seq_lengths=ql, key_value_seq_lengths=kl,
                                                    **kw)

    def loss(q, k, v):
        o = ring(q, k, v, q_lens, kv_lens)
        return jnp.sum((o * order(do)).astype(jnp.float32)), o

    sharding = NamedSharding(mesh, P("dp", "cp"))
    args = [jax.device_put(order(x), sharding) for x in (q, k, v)]
    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    _close_to_reference("o", restore(o), ref64[0], ref_o)
    for name, g, r, r64 in zip(("dq", "dk", "dv"), grads, ref_grads, ref64[1:]):
        _close_to_reference(name, restore(g), r64, r)


def check_head_sharded():
    """Heads on the dp axis (not batch), zigzag causal, against the float64 reference."""
    mesh = _mesh()
    q, k, v, do = _inputs(7)
    ref64 = _reference64(q, k, v, do, dict(is_causal=True))[0]
    base = jax_flash.dot_product_attention(q, k, v, is_causal=True)

    def f(q, k, v):
        o = jax_flash.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="cp", head_axis="dp", layout="zigzag",
                                             is_causal=True)
        return jax_flash.zigzag_restore(o, CP)
    o = jax.jit(f)(*(jax_flash.zigzag_order(x, CP) for x in (q, k, v)))
    if DTYPE == jnp.float32:
        _close("o", o, ref64, 1e-5)
    else:
        _close_to_reference("o", o, ref64, base)


def _ring_hlo(layout):
    mesh = _mesh()
    q, k, v, do = _inputs(3)

    def loss(q, k, v):
        o = jax_flash.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="cp", batch_axis="dp", layout=layout,
                                             is_causal=True)
        return jnp.sum((o * do).astype(jnp.float32))
    sharding = NamedSharding(mesh, P("dp", "cp"))
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    fwd = jax.jit(lambda q, k, v: jax_flash.ring_attention_sharded(
        q, k, v, mesh=mesh, seq_axis="cp", batch_axis="dp", layout=layout, is_causal=True)).lower(*args).compile()
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return fwd.as_text(), bwd.as_text()


def check_hlo(layout):
    """Only collective-permutes in the compiled ring, carrying local kv-head blocks [B/DP, S/CP, HKV, D] only:
    2 (CP-1) K/V blocks in the forward; in the gradient the K/V blocks again (sent again, not kept) and 2 CP dK/dV
    blocks (they travel with their block and come home); no all-gather / all-reduce / all-to-all. The ring issues
    one array per ppermute (one dtype each: jax issue 32148); XLA may combine several into one permute and send the
    last dK/dV in the inputs' dtype."""
    fwd, bwd = _ring_hlo(layout)
    for name, text in (("forward", fwd), ("gradient", bwd)):
        for op in ("all-gather", "all-reduce", "all-to-all", "reduce-scatter"):
            assert op not in text, f"{name} holds {op}"
        assert "collective-permute" in text, f"{name} holds no collective-permute"
    dims = f"{B // DP},{S // CP},{HKV},{D}"
    counts = {}
    for name, text in (("forward", fwd), ("gradient", bwd)):
        counts[name] = 0
        for _, _, op, operands in _permutes(text):
            assert operands and all(d == dims for _, d in operands), f"{name}: {op} moves {operands}, not [{dims}]"
            counts[name] += len(operands)
    assert counts["forward"] == 2 * (CP - 1), f"forward: {counts['forward']} blocks sent, expected {2 * (CP - 1)}"
    # jax 0.10's XLA still reuses the forward's K/V transfers in the backward (despite the optimization barrier).
    expected = {4 * (CP - 1) + 2 * CP} | ({2 * (CP - 1) + 2 * CP} if jax.__version__.startswith("0.10.") else set())
    assert counts["gradient"] in expected, f"gradient: {counts['gradient']} blocks sent, expected {max(expected)}"


def _computations(hlo):
    """{computation name: its instruction lines} of HLO text, in order (the schedule, in a scheduled module)."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif name and line.startswith(" ") and " = " in line:
            comps[name].append(line.strip())
    return comps


def _permutes(hlo):
    """[(computation, index, name, operands)] of the collective-permutes (or -starts) of HLO text; operands as
    [(dtype, "dims")], e.g. [("bf16", "1,32,2,32")] (XLA may combine several arrays into one permute)."""
    found = []
    for comp, lines in _computations(hlo).items():
        for i, line in enumerate(lines):
            m = re.search(r" collective-permute(-start)?\((.*?)\)(?:,|$)", line)
            if m:
                name = line.split(" = ", 1)[0].lstrip("%").split()[0]
                operands = re.findall(r"(\w+)\[([\d,]*)\]", m.group(2))
                if not operands:  # operand types not printed: read the result type
                    result = re.findall(r"(\w+)\[([\d,]+)\]", line.split(" = ", 1)[1].split(" collective-")[0])
                    # a -start's result holds its operands, then as many outputs (and scalar contexts)
                    operands = result[:len(result) // 2] if m.group(1) else result
                found.append((comp, i, name, operands))
    return found


def check_overlap(layout):
    """In the scheduled GPU HLO of the ring's forward + backward, every permute carrying K/V blocks has a jax_flash
    kernel between its start and its done: the transfer of the next block overlaps the kernel on the current one."""
    if jax.devices()[0].platform == "cpu":
        return "skip: collectives on the CPU are synchronous (no start/done pairs)"
    mesh = _mesh()
    q, k, v, do = _inputs(3)

    def loss(q, k, v):
        o = jax_flash.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="cp", batch_axis="dp", layout=layout,
                                             is_causal=True)
        return jnp.sum((o * do).astype(jnp.float32))
    sharding = NamedSharding(mesh, P("dp", "cp"))
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    if os.environ.get("JAX_FLASH_CHECK_DUMP"):
        with open(os.path.join(os.environ["JAX_FLASH_CHECK_DUMP"], f"ring-grad-{layout}.hlo.txt"), "w") as f:
            f.write(hlo)
    comps = _computations(hlo)
    has_kernel = {name: any('custom_call_target="jax_flash' in line for line in lines)
                  for name, lines in comps.items()}

    def runs_kernel(line):
        if 'custom_call_target="jax_flash' in line:
            return True
        return any(has_kernel.get(c, False) for c in re.findall(r"(?:calls|to_apply|body)=%?([\w.\-]+)", line))

    # Which instruction reads which: a K/V transfer is a permute whose result reaches a kernel within a few steps
    # (through the folds and copies that lay the block out); dK/dV transfers reach sums and outputs.
    readers = {}
    for lines in comps.values():
        for line in lines:
            name = line.split(" = ", 1)[0].lstrip("%").split()[0]
            body = line.split(" = ", 1)[1]
            for operand in re.findall(r"%([\w.\-]+)", body.split("),", 1)[0]):
                readers.setdefault(operand, []).append((name, line))

    def feeds_kernel(name, depth=5):
        for reader, line in readers.get(name, []):
            if runs_kernel(line) or (depth > 0 and not re.search(r" collective-permute(?:-start)?\(", line)
                                     and feeds_kernel(reader, depth - 1)):
                return True
        return False

    blocks, overlapped, report = 0, 0, []
    for comp, i, start, operands in _permutes(hlo):
        lines = comps[comp]
        if "collective-permute-start(" in lines[i]:
            done_index = next(j for j in range(i + 1, len(lines)) if "collective-permute-done(" in lines[j]
                              and re.search(rf"%{re.escape(start)}\b", lines[j]))
            done = lines[done_index].split(" = ", 1)[0].lstrip("%").split()[0]
            kernels = sum(runs_kernel(x) for x in lines[i + 1:done_index])
        else:
            done, kernels = start, 0  # synchronous (XLA turns a start/done pair with nothing between into one)
        kv = feeds_kernel(done)
        report.append(f"{start}: {operands}, {'K/V' if kv else 'dK/dV'}, {kernels} kernel(s) between start and done")
        if kv:
            blocks += len(operands)
            overlapped += len(operands) if kernels else 0
    assert blocks == 4 * (CP - 1), f"{blocks} K/V blocks sent in the gradient, expected {4 * (CP - 1)}: {report}"
    assert overlapped == blocks, f"only {overlapped} of {blocks} K/V blocks overlap a kernel: {report}"


def check_errors():
    mesh = _mesh()
    q, k, v, _ = _inputs(0)
    cases = [
        (dict(layout="zigzag"), jnp.zeros((B, 2 * CP * 7 + 2, HQ, D)), f"divisible by {2 * CP}"),
        (dict(layout="contiguous"), jnp.zeros((B, CP * 15 + 1, HQ, D)), f"divisible by {CP}"),
        (dict(layout="spiral"), q, "layout must be one of"),
    ]
    if DP > 1:  # a head axis that does not divide the heads
        cases.append((dict(layout="contiguous", head_axis="dp", batch_axis=None), jnp.zeros((B, S, DP + 1, D)), None))
    for kw, x, match in cases:
        kk = k if x.shape[2] == HQ else jnp.zeros((B, x.shape[1], x.shape[2], D))
        kk = kk if x.shape[1] == S else jnp.zeros((B, x.shape[1], kk.shape[2], D))
        kw = {"batch_axis": "dp", **kw}
        try:
            jax_flash.ring_attention_sharded(x, kk, kk, mesh=mesh, seq_axis="cp", **kw)
        except ValueError as e:
            assert match is None or match in str(e), (match, str(e))
        else:
            raise AssertionError(f"no error for {kw}, shape {x.shape}")
    # Inside shard_map, a local length that cannot be cut into two chunks for zigzag.
    spec = P(None, "cp")
    f = _shard_map(lambda q: jax_flash.ring_attention(q, q, q, axis_name="cp", layout="zigzag"), mesh, (spec,), spec)
    try:
        f(jnp.zeros((1, CP * 3, HQ, D)))
    except ValueError as e:
        assert "must be even" in str(e), str(e)
    else:
        raise AssertionError("odd local length accepted for zigzag")
    try:
        jax_flash.ring_attention(q, k, v, axis_name="cp")
    except ValueError as e:
        assert "inside jax.shard_map" in str(e), str(e)
    else:
        raise AssertionError("ring_attention outside shard_map accepted")


def check_zigzag_helpers():
    x = jnp.arange(2 * 16).reshape(2, 16)
    z = jax_flash.zigzag_order(x, 4)
    chunks = np.asarray(z[0]).reshape(8, 2)[:, 0] // 2
    assert chunks.tolist() == [0, 7, 1, 6, 2, 5, 3, 4], chunks
    assert (np.asarray(jax_flash.zigzag_restore(z, 4)) == np.asarray(x)).all()


def check_unplaced_inputs():
    """ring_attention_sharded takes arrays that are not yet laid out (as the README's example passes them), on meshes
    of both axis types (jax.make_mesh gives Explicit axes by default), eagerly and under jit."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((B, S, HQ, D)), DTYPE)
    k, v = (jnp.asarray(rng.standard_normal((B, S, HKV, D)), DTYPE) for _ in range(2))
    ref = np.asarray(jax_flash.dot_product_attention(q, k, v, is_causal=True), np.float32)
    tol = TOL if DTYPE == jnp.float32 else 2.0**-6  # 16 bits: a few roundings of the merged output
    auto = getattr(jax.sharding.AxisType, "Auto", None)
    for kwargs in ({}, {"axis_types": (auto, auto)}):
        mesh = jax.make_mesh((DP, CP), ("dp", "cp"), devices=jax.devices()[:DP * CP], **kwargs)
        qz, kz, vz = (jax_flash.zigzag_order(x, CP) for x in (q, k, v))
        out = jax_flash.ring_attention_sharded(qz, kz, vz, mesh=mesh, seq_axis="cp", batch_axis="dp",
                                               layout="zigzag", is_causal=True)
        np.testing.assert_allclose(np.asarray(jax_flash.zigzag_restore(out, CP), np.float32), ref, atol=tol, rtol=tol)
        f = jax.jit(lambda q, k, v: jax_flash.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="cp",
                                                                     batch_axis="dp", is_causal=True))
        np.testing.assert_allclose(np.asarray(f(q, k, v), np.float32), ref, atol=tol, rtol=tol)


def check_options(layout, explicit):
    """Packed segment ids (in the layout's order), sinks and a soft cap through the ring, causal: output and every
    gradient (the sinks' included) against the unsharded dot_product_attention with the same options (float32)
    or the float64 reference (16 bits)."""
    mesh = _mesh()
    q, k, v, do = _inputs(11)
    rng = np.random.default_rng(5)
    ids = jnp.asarray(np.stack([np.searchsorted(np.sort(rng.choice(np.arange(1, S), 3, replace=False)), np.arange(S),
                                                side="right") for _ in range(B)]), jnp.int32)
    sinks = jnp.asarray(rng.standard_normal(HQ), jnp.float32)
    kw = dict(is_causal=True, logits_soft_cap=3.0)

    def ref_loss(q, k, v, s):
        o = jax_flash.dot_product_attention(q, k, v, q_segment_ids=ids, sinks=s, **kw)
        return jnp.sum((o * do).astype(jnp.float32)), o
    (_, ref_o), ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    visible = visible_mask(S, S, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    ref64 = numpy_attention_fwd_bwd(q, k, v, do, visible, sinks=sinks, logits_soft_cap=3.0)
    order = (lambda x: jax_flash.zigzag_order(x, CP)) if layout == "zigzag" else (lambda x: x)
    restore = (lambda x: jax_flash.zigzag_restore(x, CP)) if layout == "zigzag" else (lambda x: x)

    if explicit:
        def body(q, k, v, ids, s):
            return jax_flash.ring_attention(q, k, v, axis_name="cp", layout=layout, q_segment_ids=ids, sinks=s, **kw)
        ring = _shard_map(body, mesh, (P("dp", "cp"),) * 4 + (P(),), P("dp", "cp"))
    else:
        def ring(q, k, v, ids, s):
            return jax_flash.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="cp", batch_axis="dp",
                                                    layout=layout, q_segment_ids=ids, sinks=s, **kw)

    def loss(q, k, v, s):
        o = ring(q, k, v, order(ids), s)
        return jnp.sum((o * order(do)).astype(jnp.float32)), o

    sharding = NamedSharding(mesh, P("dp", "cp"))
    args = [jax.device_put(order(x), sharding) for x in (q, k, v)]
    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args, sinks)
    _close_to_reference("o", restore(o), ref64[0], ref_o)
    for name, g, r, r64 in zip(("dq", "dk", "dv"), grads, ref_grads, ref64[1:4]):
        _close_to_reference(name, restore(g), r64, r)
    _close_to_reference("dsinks", grads[3], ref64[4], ref_grads[3])


def all_cases():
    cases = {}
    for layout in ("contiguous", "zigzag"):
        for mask in MASKS:
            cases[f"{layout}-{mask}"] = (check_ring, layout, mask, mask in ("causal", "window", "padded"))
        cases[f"hlo-{layout}"] = (check_hlo, layout)
        cases[f"overlap-{layout}"] = (check_overlap, layout)
        cases[f"options-{layout}"] = (check_options, layout, layout == "zigzag")
    cases["head_sharded"] = (check_head_sharded,)
    cases["errors"] = (check_errors,)
    cases["zigzag_helpers"] = (check_zigzag_helpers,)
    cases["unplaced_inputs"] = (check_unplaced_inputs,)
    return cases


def main(names):
    assert len(jax.devices()) >= DP * CP, f"needs {DP * CP} devices, got {jax.devices()}"
    cases = all_cases()
    results = {}
    for name in names or cases:
        fn, *args = cases[name]
        try:
            results[name] = fn(*args) or "ok"
        except Exception as e:  # noqa: BLE001 (reported to the test)
            results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
