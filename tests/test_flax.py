"""jax_flash.flax: attention_fn inside Flax's attention layers, the Attention module, and the LLaMA example.

Everything runs on CPU with small shapes. Flax's own attention (same parameters) is the reference for
``attention_fn``; ``Attention(implementation="xla")`` (jax.nn) is the reference for the kernel path of ``Attention``.
"""

import functools
import importlib.util
import json
import math
import statistics
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", reason="the Flax integration needs flax (pip install '.[flax]')")
optax = pytest.importorskip("optax", reason="the Flax integration tests need optax (pip install '.[flax]')")

from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_flash.flax  # noqa: E402
from jax_flash.flax import Attention, apply_rope, attention_fn, make_attention_fn  # noqa: E402

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
GRAD_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 4e-2}
EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples", "llama_block.py")


@pytest.fixture
def fresh_flax_warnings(monkeypatch):
    """Forget which fallbacks jax_flash.flax already warned about."""
    monkeypatch.setattr(jax_flash.attention, "_WARNED", set())


def rel_err(x, ref, scale=None):
    """max |x - ref| / max(max |ref|, scale), in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), scale or 0.0))


def assert_trees_close(tree, ref, tol, what=""):
    """Leafwise rel_err <= tol, relative to at least a tenth of the largest leaf (some gradients, like the key
    projection's bias, are zero up to rounding)."""
    leaves, ref_leaves = jax.tree.leaves(tree), jax.tree.leaves(ref)
    assert jax.tree.structure(tree) == jax.tree.structure(ref), what
    scale = 0.1 * max(float(np.max(np.abs(np.asarray(r, np.float64)))) for r in ref_leaves)
    for i, (x, r) in enumerate(zip(leaves, ref_leaves)):
        assert x.shape == r.shape, f"{what} leaf {i}"
        err = rel_err(x, r, scale)
        assert err <= tol, f"{what} leaf {i} {x.shape}: relative error {err:.2e} > {tol:.0e}"


def jax_flash_warnings(record):
    """jax_flash's fallback warnings in `record`, less the float32 notice: these tests run in float32, which on a
    GPU takes jax.nn's xla path with its own one-time warning, whatever the test is about."""
    return [w for w in record if "jax_flash" in str(w.message) and "got float32" not in str(w.message)]


def inputs(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


# ----------------------------------------------------------------------------------------------------------------
# attention_fn in nnx.MultiHeadAttention


def nnx_mha(attention=None, num_kv_heads=None, dtype=jnp.float32, **kwargs):
    """A small nnx.MultiHeadAttention (head dim 16); the same parameters whatever `attention`."""
    extra = {} if attention is None else dict(attention_fn=attention)
    return nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=64, num_kv_heads=num_kv_heads,
                                  decode=False, dtype=dtype, rngs=nnx.Rngs(0), **extra, **kwargs)


def out_and_grads(model, x, **call_kwargs):
    """Output of an nnx module and the gradients of <output, fixed random cotangent> w.r.t. its parameters."""
    cotangent = inputs(x.shape, seed=7)

    def loss(model):
        out = model(x, **call_kwargs)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return out, grads


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_nnx_mha_matches_flax(dtype, num_kv_heads):
    x = inputs((2, 16, 32), dtype=dtype)
    out, grads = out_and_grads(nnx_mha(attention_fn, num_kv_heads, dtype), x)
    ref, ref_grads = out_and_grads(nnx_mha(None, num_kv_heads, dtype), x)
    assert out.dtype == ref.dtype
    assert rel_err(out, ref) <= TOL[dtype]
    assert_trees_close(grads, ref_grads, GRAD_TOL[dtype], "param grads")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nnx_mha_causal_matches_flax_causal_mask(dtype):
    x = inputs((2, 16, 32), dtype=dtype)
    ref, ref_grads = out_and_grads(nnx_mha(None, 2, dtype), x, mask=nnx.make_causal_mask(x[..., 0]))
    # nnx.MultiHeadAttention passes its call's is_causal to attention_fn ...
    out, grads = out_and_grads(nnx_mha(attention_fn, 2, dtype), x, is_causal=True)
    assert rel_err(out, ref) <= TOL[dtype]
    assert_trees_close(grads, ref_grads, GRAD_TOL[dtype], "param grads")
    # ... and make_attention_fn(is_causal=True) stays causal although nnx passes is_causal=False.
    out, grads = out_and_grads(nnx_mha(make_attention_fn(is_causal=True), 2, dtype), x)
    assert rel_err(out, ref) <= TOL[dtype]
    assert_trees_close(grads, ref_grads, GRAD_TOL[dtype], "param grads")


# ----------------------------------------------------------------------------------------------------------------
# attention_fn in linen.MultiHeadDotProductAttention


def linen_out_and_grads(attention, params, x, dtype, **call_kwargs):
    kwargs = {} if attention is None else dict(attention_fn=attention)
    layer = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64, dtype=dtype, **kwargs)
    cotangent = inputs(x.shape, seed=7)

    def loss(params):
        out = layer.apply(params, x, **call_kwargs)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return out, grads


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_linen_mha_matches_flax(dtype):
    x = inputs((2, 16, 32), dtype=dtype)
    params = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64, dtype=dtype).init(jax.random.key(1), x)
    ref, ref_grads = linen_out_and_grads(None, params, x, dtype)
    out, grads = linen_out_and_grads(attention_fn, params, x, dtype)
    assert rel_err(out, ref) <= TOL[dtype]
    assert_trees_close(grads, ref_grads, GRAD_TOL[dtype], "param grads")

    causal = nn.make_causal_mask(x[..., 0])
    ref, ref_grads = linen_out_and_grads(None, params, x, dtype, mask=causal)
    for fn in (functools.partial(attention_fn, is_causal=True), make_attention_fn(is_causal=True)):
        out, grads = linen_out_and_grads(fn, params, x, dtype)
        assert rel_err(out, ref) <= TOL[dtype]
        assert_trees_close(grads, ref_grads, GRAD_TOL[dtype], "param grads")


def test_linen_sow_weights_is_ignored(fresh_flax_warnings):
    x = inputs((2, 16, 32))
    layer = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64, attention_fn=attention_fn)
    params = layer.init(jax.random.key(1), x)
    with pytest.warns(RuntimeWarning, match="nothing is sowed"):
        out, state = layer.apply(params, x, sow_weights=True, mutable=["intermediates"])
    ref = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64).apply(params, x)
    assert rel_err(out, ref) <= TOL[jnp.float32]


# ----------------------------------------------------------------------------------------------------------------
# attention_fn fallbacks and options


def qkv(batch_shape=(2,), seqlen=16, heads=4, kv_heads=2, head_dim=16, dtype=jnp.float32):
    return (inputs((*batch_shape, seqlen, heads, head_dim), 0, dtype),
            inputs((*batch_shape, seqlen, kv_heads, head_dim), 1, dtype),
            inputs((*batch_shape, seqlen, kv_heads, head_dim), 2, dtype))


def test_mask_falls_back_with_one_warning(fresh_flax_warnings):
    q, k, v = qkv()
    valid = jnp.arange(16)[None, :] < jnp.array([[16], [11]])
    mask = nnx.make_attention_mask(valid, valid)  # [2, 1, 16, 16] float32 padding mask
    ref = nnx.dot_product_attention(q, k, v, mask=mask)
    with pytest.warns(RuntimeWarning, match="dense mask.*is_causal=True"):
        out = attention_fn(q, k, v, mask=mask)
    assert rel_err(out, ref) <= TOL[jnp.float32]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        again = attention_fn(q, k, v, mask=mask)  # eager: the Python code runs again
    assert not jax_flash_warnings(record)
    np.testing.assert_array_equal(again, out)

    # The same padding as lengths runs the kernel (rows past the length: 0 here, but not in Flax).
    lengths = jnp.array([16, 11], jnp.int32)
    out = attention_fn(q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    assert rel_err(out * valid[..., None, None], ref * valid[..., None, None]) <= TOL[jnp.float32]
    assert not np.any(np.asarray(out)[1, 11:])


def test_mask_fallback_in_modules(fresh_flax_warnings):
    x = inputs((2, 16, 32))
    mask = nnx.make_causal_mask(x[..., 0])
    with pytest.warns(RuntimeWarning, match="dense mask"):
        out = nnx_mha(attention_fn)(x, mask=mask)
    assert rel_err(out, nnx_mha()(x, mask=mask)) <= TOL[jnp.float32]


def test_dropout_falls_back_to_flax(fresh_flax_warnings):
    x = inputs((2, 16, 32))
    ours, ref = nnx_mha(attention_fn, dropout_rate=0.5), nnx_mha(dropout_rate=0.5)
    with pytest.warns(RuntimeWarning, match="dropout"):
        out = ours(x, deterministic=False, rngs=nnx.Rngs(dropout=3))
    expected = ref(x, deterministic=False, rngs=nnx.Rngs(dropout=3))
    assert rel_err(out, expected) <= TOL[jnp.float32]
    assert rel_err(out, ref(x, deterministic=True)) > 0.1  # dropout did happen
    # Deterministic calls stay on the kernel, without warning.
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = ours(x, deterministic=True)
    assert not jax_flash_warnings(record)
    assert rel_err(out, ref(x, deterministic=True)) <= TOL[jnp.float32]


def test_dropout_fallback_keeps_the_options(fresh_flax_warnings):
    q, k, v = qkv()
    lengths = jnp.array([16, 10], jnp.int32)
    kwargs = dict(is_causal=True, local_window_size=5, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    with pytest.warns(RuntimeWarning, match="dropout"):
        out = attention_fn(q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(0), **kwargs)
    ref = jax.nn.dot_product_attention(q, k, v, **kwargs)
    # Dropout zeroes a random 30% of the weights and rescales the rest: rows stay correlated with the reference.
    assert np.corrcoef(np.ravel(out), np.ravel(ref))[0, 1] > 0.5
    assert not np.any(np.asarray(out)[1, 10:])
    np.testing.assert_allclose(attention_fn(q, k, v, dropout_rate=0.3, deterministic=True, **kwargs), ref,
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch_shape", [(), (2, 1)], ids=["none", "two"])
def test_batch_dims(batch_shape):
    q, k, v = qkv(batch_shape)
    flat = lambda x: x.reshape(-1, *x.shape[-3:])
    lengths = jnp.arange(math.prod(batch_shape), dtype=jnp.int32).reshape(batch_shape) + 10
    ref = jax.nn.dot_product_attention(flat(q), flat(k), flat(v), is_causal=True,
                                       key_value_seq_lengths=lengths.reshape(-1)).reshape(q.shape)
    out = attention_fn(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
    assert out.shape == q.shape
    assert rel_err(out, ref) <= TOL[jnp.float32]
    mask = jnp.arange(16) < lengths[..., None, None, None]  # [*batch_shape, 1, 1, 16]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = attention_fn(q, k, v, mask=mask, is_causal=True)
    assert rel_err(out, ref) <= TOL[jnp.float32]


def test_window_and_lengths_match_jax_nn():
    q, k, v = qkv(dtype=jnp.bfloat16)
    kwargs = dict(is_causal=True, local_window_size=(4, 0), query_seq_lengths=jnp.array([16, 13], jnp.int32),
                  key_value_seq_lengths=jnp.array([16, 13], jnp.int32))
    ref = jax.nn.dot_product_attention(q, k, v, **kwargs)
    assert rel_err(functools.partial(attention_fn, **kwargs)(q, k, v), ref) <= TOL[jnp.bfloat16]
    assert rel_err(attention_fn(q, k, v, **kwargs, implementation="xla"), ref) == 0


def test_dtype_cast():
    q, k, v = qkv()
    out = attention_fn(q, k, v, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    ref = jax.nn.dot_product_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    assert rel_err(out, ref) <= TOL[jnp.bfloat16]


def test_attention_fn_rejects_bad_arguments():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="implementation"):
        attention_fn(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="batch shape"):
        attention_fn(q, k, v, key_value_seq_lengths=jnp.array([3, 4, 5], jnp.int32))
    with pytest.raises(ValueError, match="batch dims"):
        attention_fn(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="implementation"):
        make_attention_fn(implementation="cuda")
    with pytest.raises(TypeError, match="is_causal"):
        make_attention_fn(is_causal="yes")


def lowered_text(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


def test_attention_fn_runs_the_custom_call():
    q, k, v = qkv()
    assert "jax_flash_fwd" in lowered_text(functools.partial(attention_fn, is_causal=True), q, k, v)
    grad = jax.grad(lambda q, k, v: attention_fn(q, k, v, is_causal=True).sum(), argnums=(0, 1, 2))
    assert "jax_flash_bwd" in lowered_text(grad, q, k, v)
    assert "jax_flash_fwd" not in lowered_text(functools.partial(attention_fn, implementation="xla"), q, k, v)


# ----------------------------------------------------------------------------------------------------------------
# apply_rope


def test_rope_matches_flax_convention():
    x = inputs((2, 16, 4, 16))
    positions = jnp.arange(16) + 5
    out = apply_rope(x, positions, theta=500.0)
    if hasattr(nnx, "RoPE"):
        ref = nnx.RoPE(theta=500.0)(jnp.swapaxes(x, 1, 2), positions.astype(jnp.float32))
        np.testing.assert_allclose(out, jnp.swapaxes(ref, 1, 2), rtol=1e-5, atol=1e-5)
    # Dimension 0 pairs with dimension 8 and rotates by the position (frequency theta ** 0 = 1).
    angle = positions[:, None]
    np.testing.assert_allclose(out[0, :, :, 0], x[0, :, :, 0] * jnp.cos(angle) - x[0, :, :, 8] * jnp.sin(angle),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(apply_rope(x, jnp.zeros(16, jnp.int32)), x)
    np.testing.assert_allclose(jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rope_scores_depend_on_relative_position():
    q, k = inputs((2, 16, 4, 16), 0), inputs((2, 16, 4, 16), 1)
    positions = jnp.arange(16)
    score = lambda m, n: jnp.sum(apply_rope(q, positions + m) * apply_rope(k, positions + n), axis=-1)
    np.testing.assert_allclose(score(7, 3), score(104, 100), rtol=1e-3, atol=1e-3)
    assert not np.allclose(score(7, 3), score(7, 5), rtol=1e-2, atol=1e-2)
    per_batch = apply_rope(q, positions[None] + jnp.array([[3], [9]]))
    np.testing.assert_allclose(per_batch[1], apply_rope(q, positions + 9)[1], rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Attention


def make_attention(implementation=None, dtype=jnp.float32, **kwargs):
    kwargs = dict(dict(d_model=64, num_heads=4, num_kv_heads=2, head_dim=16), **kwargs)
    return Attention(**kwargs, implementation=implementation, dtype=dtype, rngs=nnx.Rngs(0))


ATTENTION_CASES = {
    "causal_gqa": (dict(), dict()),
    "mqa_noncausal": (dict(num_kv_heads=1, is_causal=False), dict()),
    "window": (dict(local_window_size=(5, 0)), dict()),
    "lengths": (dict(), dict(query_seq_lengths=np.array([16, 9], np.int32),
                             key_value_seq_lengths=np.array([16, 9], np.int32))),
    "positions": (dict(rope_theta=500.0), dict(positions=np.arange(16)[None] + np.array([[0], [7]]))),
    "no_rope": (dict(rope=False), dict()),
}


@pytest.mark.parametrize("case,dtype", [(case, jnp.float32) for case in ATTENTION_CASES]
                         + [(case, jnp.bfloat16) for case in ("causal_gqa", "lengths")])
def test_attention_kernel_matches_jax_nn(case, dtype):
    init_kwargs, call_kwargs = ATTENTION_CASES[case]
    model = make_attention(dtype=dtype, **init_kwargs)
    x = inputs((2, 16, model.d_model))
    out, grads = out_and_grads(model, x, **call_kwargs)
    model.implementation = "xla"
    ref, ref_grads = out_and_grads(model, x, **call_kwargs)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) <= TOL[dtype]
    assert_trees_close(grads, ref_grads, GRAD_TOL[dtype], "param grads")


def test_attention_parameters_do_not_depend_on_implementation():
    kernel, reference = make_attention(None), make_attention("xla")
    state, ref_state = nnx.state(kernel, nnx.Param), nnx.state(reference, nnx.Param)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    assert {".".join(map(str, path)) for path, _ in nnx.to_flat_state(state)} == {
        "q_proj.kernel", "k_proj.kernel", "v_proj.kernel", "o_proj.kernel"}
    assert_trees_close(state, ref_state, 0.0)
    assert nnx.state(kernel, nnx.Param)["k_proj"]["kernel"].shape == (64, 2 * 16)
    # A checkpoint of one loads into the other.
    nnx.update(reference, state)
    x = inputs((2, 16, 64))
    assert rel_err(kernel(x), reference(x)) <= TOL[jnp.float32]


def test_attention_runs_the_custom_call():
    model = make_attention(dtype=jnp.bfloat16)
    graphdef, state = nnx.split(model)
    x = inputs((2, 16, 64), dtype=jnp.bfloat16)
    forward = lambda state, x: nnx.merge(graphdef, state)(x)
    loss = lambda state, x: forward(state, x).astype(jnp.float32).sum()
    assert "jax_flash_fwd" in lowered_text(forward, state, x)
    assert "jax_flash_bwd" in lowered_text(jax.grad(loss), state, x)
    model.implementation = "xla"
    graphdef, state = nnx.split(model)
    assert "jax_flash_fwd" not in lowered_text(lambda state, x: nnx.merge(graphdef, state)(x), state, x)


def test_attention_under_nnx_jit_and_grad():
    model = make_attention(dtype=jnp.bfloat16)
    x = inputs((2, 16, 64), dtype=jnp.bfloat16)
    loss = lambda model, x: jnp.mean(jnp.square(model(x).astype(jnp.float32)))

    @nnx.jit
    def loss_and_grads(model, x):
        return nnx.value_and_grad(loss)(model, x)

    value, grads = loss_and_grads(model, x)
    eager_value, eager_grads = nnx.value_and_grad(loss)(model, x)
    assert float(value) == pytest.approx(float(eager_value), rel=1e-2)
    assert_trees_close(grads, eager_grads, 2e-2)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_adam_step_lowers_the_loss():
    model = make_attention(dtype=jnp.bfloat16)
    x, y = inputs((4, 16, 64), 0, jnp.bfloat16), inputs((4, 16, 64), 1)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    loss = lambda model: jnp.mean(jnp.square(model(x).astype(jnp.float32) - y))

    def step(model, optimizer):
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    before = float(step(model, optimizer))
    for _ in range(3):
        step(model, optimizer)
    assert float(loss(model)) < before


def test_implementation_is_the_one_switch():
    """``implementation`` (default None, the kernel) is the only way to choose the attention computation."""
    rngs = nnx.Rngs(0)
    assert Attention(64, 4, 2, rngs=rngs).implementation is None
    assert Attention(64, 4, 2, implementation="xla", rngs=rngs).implementation == "xla"
    with pytest.raises(TypeError, match="use_kernel"):
        Attention(64, 4, 2, use_kernel=False, rngs=rngs)
    with pytest.raises(TypeError, match="use_kernel"):
        make_attention_fn(use_kernel=False)
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="use_kernel"):  # not swallowed with the other keywords Flax may pass
        attention_fn(q, q, q, use_kernel=False)


def test_callable_implementation_runs_on_the_same_weights():
    """A callable implementation (another attention to compare with) gets the layer's projected, rotated q, k, v
    and is_causal; options it cannot take, and prefill / decode, are clear errors."""
    calls = []

    def other(q, k, v, *, is_causal):
        calls.append((q.shape, k.shape, is_causal))
        return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation="xla")

    model = make_attention()
    x = inputs((2, 16, model.d_model))
    model.implementation = "xla"
    ref, ref_grads = out_and_grads(model, x)
    model.implementation = other
    out, grads = out_and_grads(model, x)
    assert calls and calls[0] == ((2, 16, 4, 16), (2, 16, 2, 16), True)
    assert rel_err(out, ref) == 0
    assert_trees_close(grads, ref_grads, 0.0, "param grads")
    with pytest.raises(ValueError, match="takes q, k, v and is_causal only, not segment_ids"):
        model(x, segment_ids=jnp.zeros((2, 16), jnp.int32))
    windowed = make_attention(local_window_size=4, implementation=other)
    with pytest.raises(ValueError, match="not local_window_size"):
        windowed(x)
    cache = model.init_cache(2, 32)
    with pytest.raises(ValueError, match="prefill: a callable implementation is only used by"):
        model.prefill(x, cache)
    with pytest.raises(ValueError, match="decode: a callable implementation"):
        model.decode(x[:, :1], cache)


def test_attention_rejects_bad_arguments():
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Attention(64, 4, 3, rngs=rngs)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        Attention(60, 8, rngs=rngs)
    with pytest.raises(ValueError, match="even"):
        Attention(60, 4, head_dim=15, rngs=rngs)
    with pytest.raises(ValueError, match="implementation"):
        Attention(64, 4, implementation="flash", rngs=rngs)
    model = make_attention()
    with pytest.raises(ValueError, match="d_model"):
        model(inputs((2, 16, 32)))
    with pytest.raises(ValueError, match="positions"):
        model(inputs((2, 16, 64)), positions=jnp.arange(15))
    model.implementation = "flash"
    with pytest.raises(ValueError, match="implementation"):
        model(inputs((2, 16, 64)))


# ----------------------------------------------------------------------------------------------------------------
# examples/llama_block.py


def run_example(*args, **env):
    """Runs the example on the CPU (as every test of this module) with `env` added to the environment."""
    proc = subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_example_lowers_the_full_size_block():
    out = run_example("--mode", "bench", "--dry-run", "--attention", "jax_flash")
    assert out.count("calls jax_flash_fwd + jax_flash_bwd") == 2, out


def test_example_check_writes_its_results(tmp_path):
    run_example("--mode", "check", "--config", "tiny", "--batch", "1", "--seq", "64", "--attention", "jax_flash", "xla",
                "--out", str(tmp_path))
    checks = json.loads((tmp_path / "llama_block-check-cpu.json").read_text())["checks"]
    assert [c["passed"] for c in checks] == [True]


def test_example_bench_without_a_gpu_is_a_smoke_run(tmp_path):
    """On the CPU: says it is a smoke run, reports no MFU (there is no known peak), writes to the temp dir; the step
    time of each row is the median of its interleaved rounds, whose spread the table shows."""
    out = run_example("--mode", "bench", "--config", "tiny", "--batch", "1", "--seq", "64", "--attention", "jax_flash",
                      "xla", "--steps", "1", "--warmup", "0", "--rounds", "3", "--no-isolate", TMPDIR=str(tmp_path))
    assert "No GPU: a smoke run" in out and "No MFU: no GPU" in out and "MFU 0" not in out
    assert "round 1/3: jax_flash" in out and "round 2/3: xla" in out  # the order rotates each round
    (md,) = (tmp_path / "jax_flash_bench").glob("llama_block-cpu-*.md")
    text = md.read_text()
    assert "Smoke run without a GPU" in text and "No MFU" in text and "median over 3 interleaved rounds" in text
    row = next(line for line in text.splitlines() if line.startswith("| 1 x 64 | jax_flash"))
    cells = row.split(" | ")
    assert cells[6] == "–"  # the MFU column
    (result,) = (tmp_path / "jax_flash_bench").glob("llama_block-cpu-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [r["attention"] for r in rows] == ["jax_flash", "xla"]
    for r in rows:
        assert len(r["step_ms_rounds"]) == 3 and r["step_ms"] == statistics.median(r["step_ms_rounds"])
        assert r["tokens_per_s"] == pytest.approx(64 / (r["step_ms"] / 1e3)) and r["step_ms_isolated"] > 0
    low, high = (float(v) for v in cells[3].split("–"))
    assert low == pytest.approx(min(rows[0]["step_ms_rounds"]), abs=6e-3)
    assert high == pytest.approx(max(rows[0]["step_ms_rounds"]), abs=6e-3)


def test_example_multi_device_smoke_run(tmp_path):
    """--mode multi on 2 simulated CPU devices: one row per (devices, strategy, attention), the collectives each
    strategy should hold (jax_flash adds none to data parallelism: only the gradients' all-reduce), rows carrying
    the device, jax version and date."""
    run_example("--mode", "multi", "--steps", "1", "--warmup", "0", "--out", str(tmp_path), "--name", "multi",
                XLA_FLAGS="--xla_force_host_platform_device_count=2")
    rows = json.loads((tmp_path / "multi.json").read_text())["rows"]
    assert not [r for r in rows if r["error"]], rows
    block = {(r["devices"], r["strategy"], r["impl"]): r for r in rows if r["kind"] == "block"}
    assert set(block) == {(1, "dp", a) for a in ("jax_flash", "xla")} | {
        (2, s, a) for s in ("dp", "fsdp", "tp") for a in ("jax_flash", "xla")}
    assert block[(1, "dp", "jax_flash")]["collectives"] == {}
    assert set(block[(2, "dp", "jax_flash")]["collectives"]) == {"all-reduce"}
    assert block[(2, "dp", "jax_flash")]["tokens"] == 2 * block[(1, "dp", "jax_flash")]["tokens"]
    assert "all-gather" in block[(2, "fsdp", "jax_flash")]["collectives"]
    cp = {(r["devices"], r["strategy"]): r for r in rows if r["kind"] == "cp_attention"}
    assert set(cp) == {(1, "single"), (2, "ring"), (2, "allgather")}
    assert set(cp[(2, "ring")]["collectives"]) == {"collective-permute"}
    assert set(cp[(2, "allgather")]["collectives"]) <= {"all-gather", "all-reduce"}
    assert cp[(2, "ring")]["seqlen"] == 2 * cp[(1, "single")]["seqlen"]
    for r in rows:
        assert r["device"] == "cpu" and r["jax_version"] == jax.__version__ and r["date"]
        assert (r.get("tokens_per_s") or r.get("tflops_per_device")) > 0


def _example_module():
    spec = importlib.util.spec_from_file_location("llama_block", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_example_packed_batches():
    """Each row packs the asked number of documents: ids count up from 0, positions restart at each document, and
    inside a document the tokens are an arithmetic progression."""
    example = _example_module()
    tokens, segment, positions = example.packed_progression_batch(jax.random.key(0), batch=3, seqlen=40, vocab=256,
                                                                  docs=5)
    tokens, segment, positions = (np.asarray(x) for x in (tokens, segment, positions))
    assert tokens.shape == segment.shape == positions.shape == (3, 41)
    for b in range(3):
        assert segment[b, 0] == 0 and segment[b, -1] == 4 and (np.diff(segment[b]) >= 0).all()
        starts = np.flatnonzero(np.diff(segment[b])) + 1
        assert (positions[b, starts] == 0).all() and positions[b, 0] == 0
        for doc in range(5):
            steps = np.diff(tokens[b, segment[b] == doc]) % 256
            assert len(set(steps.tolist())) <= 1


def test_example_trains_on_packed_sequences():
    out = run_example("--mode", "train", "--packed", "4", "--steps", "25")
    assert "4 documents packed per row" in out and "-> " in out


def test_example_mfu_only_against_a_known_peak():
    example = _example_module()
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert example.mfu_peak(None, "NVIDIA H100 80GB HBM3", True, bf16) == (
        989.0, "the dense bfloat16/float16 peak of the H100 SXM")
    assert example.mfu_peak(None, "NVIDIA H100 80GB HBM3", True, f32)[0] is None
    assert example.mfu_peak(None, "NVIDIA GeForce RTX 4090", True, bf16)[0] is None
    assert example.mfu_peak(None, "cpu", False, bf16) == (None, "no GPU (a smoke run)")
    assert example.mfu_peak(500.0, "cpu", False, bf16) == (500.0, "--peak-tflops")


def test_attention_owns_sinks_and_soft_cap_and_takes_segment_ids():
    """Attention(sinks=True, logits_soft_cap=c)(x, segment_ids=...) equals dot_product_attention on its projections,
    and the sinks parameter gets a gradient; attention_fn passes the options through."""
    layer = Attention(64, 4, 2, 16, sinks=True, logits_soft_cap=20.0, dtype=jnp.float32, rngs=nnx.Rngs(0))
    layer.sinks[...] = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, 24, 64), jnp.float32)
    ids = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], [8, 8, 8], axis=1), jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # segment ids and soft cap: the materialised path
        out = layer(x, segment_ids=ids)
        q = apply_rope(layer.q_proj(x).reshape(2, 24, 4, 16), jnp.arange(24), layer.rope_theta)
        k = apply_rope(layer.k_proj(x).reshape(2, 24, 2, 16), jnp.arange(24), layer.rope_theta)
        v = layer.v_proj(x).reshape(2, 24, 2, 16)
        expected = jax_flash.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=ids,
                                                   sinks=layer.sinks[...], logits_soft_cap=20.0)
        np.testing.assert_allclose(out, layer.o_proj(expected.reshape(2, 24, 64)), atol=1e-5)
        through_fn = attention_fn(q, k, v, is_causal=True, q_segment_ids=ids, sinks=layer.sinks[...],
                                  logits_soft_cap=20.0)
        np.testing.assert_allclose(through_fn, expected, atol=1e-6)
        grads = nnx.grad(lambda m: jnp.sum(m(x, segment_ids=ids) ** 2))(layer)
    assert grads.sinks[...].shape == (4,) and np.abs(np.asarray(grads.sinks[...])).sum() > 0
    with pytest.raises(ValueError, match="cannot be combined with a dense mask"):
        attention_fn(q, k, v, mask=jnp.ones((24, 24), bool), sinks=layer.sinks[...])


# -- KV-cache generation ---------------------------------------------------------------------------------------


def _cache_layer(implementation=None, **kw):
    return Attention(64, 4, 2, 16, implementation=implementation, dtype=jnp.float32, rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("kw", [dict(), dict(local_window_size=(5, 0))])
def test_prefill_and_decode_match_the_full_forward(implementation, kw):
    """prefill(prompt) then decode of 1 and 3 tokens gives the rows of one causal call over the whole sequence,
    and the cache holds the sequence's keys."""
    layer = _cache_layer(implementation, **kw)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 12, 64)), jnp.float32)
    full = layer(x)
    cache = layer.init_cache(2, 20)
    y0, cache = layer.prefill(x[:, :8], cache)
    step = jax.jit(lambda x, c: layer.decode(x, c), donate_argnums=1)
    y1, cache = step(x[:, 8:9], cache)
    y2, cache = step(x[:, 9:12], cache)
    got = jnp.concatenate([y0, y1, y2], axis=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [12, 12] and not cache.k[:, 12:].any()


def test_cache_misuse_under_jit_gives_nan_not_a_wrong_answer():
    """Traced lengths cannot raise: decoding past max_len (the writes clipped onto the last slots) and prefill
    lengths past the prompt give that sequence nan outputs; the others stay right. Eager calls raise."""
    layer = _cache_layer()
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 64)), jnp.float32)
    _, cache = layer.prefill(x, layer.init_cache(2, 6), lengths=jnp.asarray([5, 2], jnp.int32))
    step = jax.jit(lambda x, c: layer.decode(x, c))
    y, _ = step(x[:, :2], cache)  # sequence 0: 5 + 2 > 6
    assert np.isnan(np.asarray(y[0])).all() and np.isfinite(np.asarray(y[1])).all()
    with pytest.raises(ValueError, match="the cache is full"):
        layer.decode(x[:, :2], cache)
    y, _ = jax.jit(lambda x, n: layer.prefill(x, layer.init_cache(2, 6), lengths=n))(x, jnp.asarray([7, 2], jnp.int32))
    assert np.isnan(np.asarray(y[0])).all() and np.isfinite(np.asarray(y[1])).all()


def test_cache_of_another_dtype_than_the_layer():
    """A float32 cache for a bfloat16 layer (init_cache(dtype=...)): decode runs, as the bfloat16 cache does."""
    layer = Attention(64, 4, 2, 16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 6, 64)), jnp.bfloat16)
    outs = []
    for dtype in (jnp.bfloat16, jnp.float32):
        _, cache = layer.prefill(x[:, :5], layer.init_cache(2, 8, dtype))
        y, cache = layer.decode(x[:, 5:], cache)
        assert cache.k.dtype == dtype
        outs.append(np.asarray(y, np.float32))
    np.testing.assert_allclose(outs[0], outs[1], atol=3e-2, rtol=3e-2)


def test_prefill_needs_a_causal_layer():
    layer = _cache_layer(is_causal=False)
    with pytest.raises(ValueError, match="prefill needs a causal layer"):
        layer.prefill(jnp.zeros((1, 4, 64)), layer.init_cache(1, 8))


def test_flax_decode_with_a_causal_attention_fn_is_refused():
    """Flax's own decode=True step: one query row against the whole cache under Flax's cache mask. A causal (or
    windowed) attention_fn would align its mask top-left there (the row sees key 0 only): refused with a clear
    error; the plain attention_fn decodes right. Flax's RoPE input_positions are refused too (never applied)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((1, 6, 32)), jnp.float32)
    for fn, ok in ((jax_flash.flax.make_attention_fn(is_causal=True), False), (jax_flash.flax.attention_fn, True)):
        layer = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32, decode=True,
                                       attention_fn=fn, rngs=nnx.Rngs(0))
        ref = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32, decode=False, rngs=nnx.Rngs(0))
        layer.init_cache((1, 6, 32), dtype=jnp.float32)
        if not ok:
            with pytest.raises(ValueError, match="Flax's decode=True cache step"):
                layer(x[:, :1])
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the cache mask: jax.nn fallback, warned)
            steps = [layer(x[:, t:t + 1]) for t in range(6)]
        want = ref(x, mask=nnx.make_causal_mask(jnp.ones((1, 6))))
        np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(want), atol=1e-5, rtol=1e-5)
    q = jnp.ones((1, 4, 2, 16))
    with pytest.raises(TypeError, match="input_positions would be ignored"):
        jax_flash.flax.attention_fn(q, q, q, input_positions=jnp.arange(4))


def test_decode_kernel_and_jax_nn_agree_on_ragged_caches():
    """Sequences at different lengths (prompts right-padded at prefill) decode alike with the kernel and jax.nn."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 6, 64)), jnp.float32)
    nxt = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.float32)
    lengths = jnp.asarray([6, 2, 4], jnp.int32)
    outs = []
    for implementation in (None, "xla"):
        layer = _cache_layer(implementation)
        _, cache = layer.prefill(x, layer.init_cache(3, 16), lengths=lengths)
        y, cache = layer.decode(nxt, cache)
        outs.append(y)
        assert cache.lengths.tolist() == [8, 4, 6]
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), atol=1e-5, rtol=1e-5)
    # each sequence's new tokens equal a full causal call over its own prompt + tokens
    layer = _cache_layer()
    for b in range(3):
        n = int(lengths[b])
        seq = jnp.concatenate([x[b:b + 1, :n], nxt[b:b + 1]], axis=1)
        np.testing.assert_allclose(np.asarray(outs[0][b]), np.asarray(layer(seq)[0, n:]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_equal_lengths_cache_matches_per_sequence_lengths(implementation):
    """A cache of equal_lengths keeps one length for the batch (lengths int32 []): prefill and decode steps of 1 and
    3 tokens give what a cache of per-sequence lengths gives, with the kernel (decode_attention's one length) and
    with jax.nn; prefill then takes no per-sequence lengths."""
    layer = _cache_layer(implementation)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 12, 64)), jnp.float32)
    got = {}
    for equal in (False, True):
        cache = layer.init_cache(3, 20, equal_lengths=equal)
        assert cache.lengths.shape == (() if equal else (3,))
        y0, cache = layer.prefill(x[:, :8], cache)
        step = jax.jit(lambda x, c: layer.decode(x, c), donate_argnums=1)
        y1, cache = step(x[:, 8:9], cache)
        y2, cache = step(x[:, 9:12], cache)
        assert cache.lengths.shape == (() if equal else (3,)) and (np.asarray(cache.lengths) == 12).all()
        got[equal] = (jnp.concatenate([y0, y1, y2], axis=1), cache.k, cache.v)
    for a, b in zip(got[False], got[True]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[True][0]), np.asarray(layer(x)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="prefill without `lengths`"):
        layer.prefill(x[:, :8], layer.init_cache(3, 20, equal_lengths=True), lengths=jnp.full((3,), 8, jnp.int32))
    with pytest.raises(TypeError, match="equal_lengths must be a bool"):
        layer.init_cache(3, 20, equal_lengths=1)


def test_decode_rejects_bad_arguments():
    layer = _cache_layer()
    cache = layer.init_cache(2, 8)
    with pytest.raises(ValueError, match="1 to 16 new tokens"):
        layer.decode(jnp.zeros((2, 17, 64)), cache)
    with pytest.raises(ValueError, match="KVCache from init_cache for this batch"):
        layer.decode(jnp.zeros((3, 1, 64)), cache)
    with pytest.raises(ValueError, match="does not fit the cache"):
        layer.prefill(jnp.zeros((2, 9, 64)), cache)
    with pytest.raises(ValueError, match="jax_flash options"):
        _cache_layer("xla", sinks=True).decode(jnp.zeros((2, 1, 64)), cache)
    # prompt lengths past the prompt, negative, or not integers would leave the cache counting unwritten slots
    x = jnp.zeros((2, 4, 64))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\] \(the prompt's length\), got \[6, 4\]"):
        layer.prefill(x, cache, lengths=jnp.asarray([6, 4], jnp.int32))
    with pytest.raises(ValueError, match="lengths must lie in"):
        layer.prefill(x, cache, lengths=jnp.asarray([-1, 4], jnp.int32))
    with pytest.raises(TypeError, match="lengths must be int32, got float32"):
        layer.prefill(x, cache, lengths=jnp.asarray([2.7, 4.0]))
    with pytest.raises(ValueError, match=r"lengths must have shape \(batch,\) = \(2,\)"):
        layer.prefill(x, cache, lengths=jnp.asarray(3, jnp.int32))
    with pytest.raises(TypeError, match="max_len must be an int"):
        layer.init_cache(2, 2.5)
    with pytest.raises(ValueError, match="batch must be >= 0"):
        layer.init_cache(-1, 8)
    # eager decode into a full cache
    _, full = layer.prefill(jnp.zeros((2, 8, 64)), cache)
    with pytest.raises(ValueError, match=r"the cache is full: .* exceed its max_len 8"):
        layer.decode(jnp.zeros((2, 1, 64)), full)


def test_example_generate_smoke_run(tmp_path):
    """--mode generate prefills, decodes through the caches with each attention choice and writes its results;
    greedy tokens agree between the kernel and jax.nn on the CPU (float32 attention, tiny model)."""
    out = run_example("--mode", "generate", "--dtype", "float32", "--steps", "5", "--out", str(tmp_path),
                      "--name", "gen")
    assert "Smoke run without a GPU" in (tmp_path / "gen.md").read_text()
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    assert [r["attention"] for r in rows] == ["jax_flash", "xla"]
    assert all(r["tokens_per_s"] > 0 and r["agree"] == 1.0 and r["steps"] == 5 for r in rows), out


def test_example_bench_table_names_the_best_peer():
    """The bench table ends with jax_flash's tokens/s over the best peer's per shape (cudnn, fa3_jax, tokamax) and
    lists the peers that were skipped."""
    example = _example_module()
    meta = dict(device="GPU", jax_version="0", date="today", dtype="bfloat16", config_name="llama3-8b",
                config=dict(d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336), steps=1, rounds=1,
                warmup=0, smoke=False, flops_formula="f", peak_tflops=None, peak_note="none", memory_note="m",
                skipped={"tokamax": "not installed (ModuleNotFoundError: No module named 'tokamax')"})

    def row(attention, tokens_per_s, error=None):
        return dict(attention=attention, batch=2, seqlen=4096, step_ms=1.0, tokens_per_s=tokens_per_s, tflops=1.0,
                    mfu=None, peak_bytes=None, xla_total_bytes=None, error=error)

    rows = [row("jax_flash", 420e3), row("cudnn", 400e3), row("xla", 500e3), row("fa3_jax", 440e3)]
    md = example.markdown(meta, [], rows)
    assert "jax_flash tokens/s / the best peer's (cudnn, fa3_jax): 2 x 4096: 0.955 (fa3_jax)." in md  # xla: no peer
    assert "Not run: tokamax: not installed" in md
    assert example.unavailable("fa3_jax", on_gpu=False) == "GPU only"
    assert example.unavailable("xla", on_gpu=False) is None


@pytest.mark.parametrize("args, message", [
    (["--mode", "train", "--steps", "3"], "--mode train needs --steps >= 6"),
    (["--mode", "generate", "--steps", "3", "--out", "{file}/x"], "cannot create the results directory"),
    (["--mode", "multi", "--attention", "cudnn"], "--attention cudnn:"),
    (["--mode", "train", "--check-tol", "0.1"], "--check-tol applies to --mode check / bench only"),
    (["--mode", "generate", "--lr", "0.1"], "--lr applies to --mode train only"),
    (["--mode", "train", "--cache-lengths", "equal"], "--cache-lengths applies to --mode generate only"),
    (["--mode", "train", "--no-latency-hiding"], "--no-latency-hiding applies to --mode multi only"),
    (["--mode", "train", "--lr", "0"], "--lr must be positive, got 0.0"),
    (["--mode", "train", "--packed", "4", "--attention", "xla"], "--packed (segment ids) needs --attention jax_flash"),
    (["--mode", "check", "--config", "tiny", "--attention", "xla"], "--mode check compares two or more"),
    (["--mode", "generate", "--warmup", "5"], "--warmup applies to --mode bench / multi only"),
])
def test_example_argument_errors_come_before_any_work(tmp_path, args, message):
    (tmp_path / "file").write_text("")
    args = [a.replace("{file}", str(tmp_path / "file")) for a in args]
    proc = subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "step" not in proc.stdout
