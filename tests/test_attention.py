"""jax_flash.dot_product_attention on CPU: accuracy, transformations, residuals, validation and fallbacks."""

import functools
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import attention as attention_module

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]

# Fields of conftest.Case. Lengths 1, 17, 97 and 1000; head dims 8, 64, 72, 128 and 256.
CASES = {
    "sq1_d8": dict(batch=2, seqlen_q=1, seqlen_k=97, heads_q=2, heads_kv=2, head_dim=8),
    "square_d64": dict(batch=2, seqlen_q=17, seqlen_k=17, heads_q=4, heads_kv=4, head_dim=64),
    "causal_sq_gt_sk_d72": dict(batch=1, seqlen_q=97, seqlen_k=17, heads_q=2, heads_kv=2, head_dim=72,
                                is_causal=True),
    "gqa4_causal_d128": dict(batch=2, seqlen_q=97, seqlen_k=97, heads_q=8, heads_kv=2, head_dim=128,
                             is_causal=True),
    "mqa_d256": dict(batch=1, seqlen_q=17, seqlen_k=33, heads_q=4, heads_kv=1, head_dim=256),
    "window_int": dict(batch=1, seqlen_q=97, seqlen_k=97, heads_q=2, heads_kv=2, head_dim=64, window=5),
    "window_left_causal_gqa": dict(batch=1, seqlen_q=97, seqlen_k=97, heads_q=4, heads_kv=1, head_dim=64,
                                   is_causal=True, window=(7, 0)),
    "window_0_0": dict(batch=2, seqlen_q=17, seqlen_k=17, heads_q=2, heads_kv=2, head_dim=32, window=(0, 0)),
    "window_asymmetric_sq_lt_sk": dict(batch=1, seqlen_q=33, seqlen_k=97, heads_q=2, heads_kv=2, head_dim=64,
                                       window=(2, 9)),
    "window_leaves_rows_empty": dict(batch=1, seqlen_q=40, seqlen_k=17, heads_q=2, heads_kv=2, head_dim=64,
                                     window=(0, 0)),
    "window_huge": dict(batch=1, seqlen_q=17, seqlen_k=33, heads_q=2, heads_kv=2, head_dim=64, is_causal=True,
                        window=10**9),
    "lengths": dict(batch=3, seqlen_q=33, seqlen_k=47, heads_q=2, heads_kv=2, head_dim=64,
                    q_lens=(33, 5, 0), kv_lens=(47, 1, 20)),
    "kv_length_zero": dict(batch=2, seqlen_q=17, seqlen_k=17, heads_q=2, heads_kv=2, head_dim=64,
                           kv_lens=(0, 9)),
    "lengths_out_of_range": dict(batch=2, seqlen_q=17, seqlen_k=17, heads_q=2, heads_kv=2, head_dim=64,
                                 q_lens=(40, -3), kv_lens=(100, 5)),
    "combined": dict(batch=3, seqlen_q=97, seqlen_k=61, heads_q=8, heads_kv=2, head_dim=72, is_causal=True,
                     window=(11, 3), q_lens=(97, 50, 1), kv_lens=(61, 30, 0)),
    "long_causal_1000": dict(batch=1, seqlen_q=1000, seqlen_k=1000, heads_q=2, heads_kv=1, head_dim=64,
                             is_causal=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case, dtype, attention_checks):
    attention_checks.check_against_reference(attention_checks.Case(**case), dtype)


@pytest.mark.parametrize("path", ["kernel", "xla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_rows_that_see_no_key_are_zero_with_finite_gradients(dtype, path, attention_checks, monkeypatch):
    """Also on the XLA path (float32 on a GPU, platforms without a kernel), whose jax.nn call alone would give such a
    row the mean of the values and a gradient."""
    if path == "xla":
        if dtype == jnp.float16:
            pytest.skip("XLA's CPU dot_general has no float16 x float16 -> float32 (jax.nn's backward needs it)")
        monkeypatch.setattr(jax_flash.attention, "_kernel_platforms", lambda dtype: ())
    case = attention_checks.Case(batch=2, seqlen_q=9, seqlen_k=9, heads_q=2, heads_kv=1, head_dim=16,
                                 window=(0, 0), kv_lens=(0, 3))
    q, k, v, do = attention_checks.make_inputs(case, dtype)
    out, dq, dk, dv = attention_checks.fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, **case.kwargs())
    _, lse = jax_flash.dot_product_attention(q, k, v, return_residual=True, **case.kwargs())
    assert np.all(np.asarray(lse)[0] == -np.inf) and np.all(np.asarray(lse)[1, 3:] == -np.inf)
    for x in (out, dq, dk, dv):
        assert np.isfinite(x).all()
    assert not out[0].any() and not dq[0].any()  # kv length 0: nothing to attend to
    assert not out[1, 3:].any() and not dq[1, 3:].any()  # window (0, 0) past the kv length
    assert not dk[0].any() and not dv[0].any() and not dk[1, 3:].any() and not dv[1, 3:].any()
    assert out[1, :3].all()


def test_float32_error_does_not_grow_with_the_sequence():
    """Float32 at 8192 keys (one head, d64): output and gradients within 2.5x jax.nn's error against float64. A
    kernel that sums every key's contribution into one running float32 sum (the CPU kernel before session 78) was
    3.3-6.3x there; adding each tile's product keeps it near 1x."""
    rng = np.random.default_rng(5)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, 8192, 1, 64)), jnp.float32) for _ in range(4))

    def fwd_bwd(f):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v), q, k, v)
        return [np.asarray(x, np.float64)[0, :, 0] for x in (out, *vjp(do))]

    ours = fwd_bwd(jax.jit(jax_flash.dot_product_attention))
    base = fwd_bwd(jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="xla")))
    Q, K, V, DO = (np.asarray(x, np.float64)[0, :, 0] for x in (q, k, v, do))
    ref = [np.zeros_like(Q), np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)]
    for r0 in range(0, 8192, 1024):  # float64, 1024 rows at a time
        rows = slice(r0, r0 + 1024)
        logits = Q[rows] @ K.T / 8.0
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        o = p @ V
        ds = p * (DO[rows] @ V.T - (DO[rows] * o).sum(1, keepdims=True)) / 8.0
        ref[0][rows], ref[1][rows] = o, ds @ K
        ref[2] += ds.T @ Q[rows]
        ref[3] += p.T @ DO[rows]
    for name, x, b, r in zip(("out", "dq", "dk", "dv"), ours, base, ref):
        err, base_err = (np.abs(y - r).max() / np.abs(r).max() for y in (x, b))
        assert err <= 2.5 * base_err, (name, err, base_err)


@pytest.mark.parametrize("scale", [0.37, -0.6, 0.0, 1e-40, -1e-40, 1e-30])
def test_scale(scale, attention_checks):
    case = attention_checks.Case(batch=1, seqlen_q=17, seqlen_k=17, heads_q=2, heads_kv=2, head_dim=64,
                                 is_causal=True)
    q, k, v, do = attention_checks.make_inputs(case, jnp.float32)
    ours = attention_checks.fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, scale=scale, is_causal=True)
    ref = attention_checks.numpy_reference(case, q, k, v, do, scale=scale)
    for x, r in zip(ours, ref):
        np.testing.assert_allclose(x, r, atol=2e-5, rtol=1e-4)


# Transformations. Float32 inputs; results compared with the untransformed call.

SMALL = dict(batch=2, seqlen_q=17, seqlen_k=23, heads_q=4, heads_kv=2, head_dim=32, is_causal=True)


def attend(q, k, v, q_lens=None, kv_lens=None):
    return jax_flash.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=q_lens,
                                           key_value_seq_lengths=kv_lens)


def loss(q, k, v):
    return jnp.sum(attend(q, k, v) ** 2)


def assert_close(x, y):
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.fixture
def small_inputs(attention_checks):
    return attention_checks.make_inputs(attention_checks.Case(**SMALL), jnp.float32)[:3]


def test_jit(small_inputs):
    assert_close(jax.jit(attend)(*small_inputs), attend(*small_inputs))


def test_grad_and_value_and_grad(small_inputs, attention_checks):
    q, k, v = small_inputs
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    value, grads2 = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    ref_value, ref_grads = jax.value_and_grad(
        lambda q, k, v: jnp.sum(jax_flash.reference_attention(q, k, v, is_causal=True) ** 2), argnums=(0, 1, 2)
    )(q, k, v)
    assert_close(grads, grads2)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def _take(x, axis, i):
    return None if x is None else jnp.take(x, i, axis=axis)


@pytest.mark.parametrize("axis", [0, 2, -1])
@pytest.mark.parametrize("batched", ["".join(s) for n in (1, 2, 3) for s in itertools.combinations("qkv", n)])
def test_vmap(batched, axis, small_inputs):
    size = 3
    args, in_axes = [], []
    for name, x in zip("qkv", small_inputs):
        if name in batched:
            x = jnp.stack([x * (1 + 0.5 * i) for i in range(size)], axis=axis)
        args.append(x)
        in_axes.append(axis if name in batched else None)
    out = jax.vmap(attend, in_axes=tuple(in_axes))(*args)
    expected = jnp.stack([attend(*(x if a is None else _take(x, a, i) for x, a in zip(args, in_axes)))
                          for i in range(size)])
    assert_close(out, expected)


def test_vmap_out_axes(small_inputs):
    q, k, v = small_inputs
    qs = jnp.stack([q, -q])
    out = jax.vmap(attend, in_axes=(0, None, None), out_axes=2)(qs, k, v)
    assert_close(out, jnp.stack([attend(q, k, v), attend(-q, k, v)], axis=2))


def test_vmap_lengths(small_inputs):
    q, k, v = small_inputs
    q_lens = jnp.array([[17, 3], [0, 12], [9, 17]], jnp.int32)
    kv_lens = jnp.array([[23, 1], [5, 0], [23, 23]], jnp.int32)
    out = jax.vmap(attend, in_axes=(None, None, None, 0, 0))(q, k, v, q_lens, kv_lens)
    assert_close(out, jnp.stack([attend(q, k, v, a, b) for a, b in zip(q_lens, kv_lens)]))
    qs = jnp.stack([q, 2 * q, -q])
    out = jax.vmap(attend, in_axes=(0, None, None, None, 0))(qs, k, v, q_lens[0], kv_lens)
    assert_close(out, jnp.stack([attend(x, k, v, q_lens[0], b) for x, b in zip(qs, kv_lens)]))


def test_grad_of_vmap(small_inputs):
    q, k, v = small_inputs
    qs, vs = jnp.stack([q, 2 * q]), jnp.stack([v, -v])

    def batched_loss(qs, k, vs):
        return jnp.sum(jax.vmap(attend, in_axes=(0, None, 0))(qs, k, vs) ** 2)

    grads = jax.grad(batched_loss, argnums=(0, 1, 2))(qs, k, vs)
    per_example = [jax.grad(loss, argnums=(0, 1, 2))(qs[i], k, vs[i]) for i in range(2)]
    assert_close(grads[0], jnp.stack([g[0] for g in per_example]))
    assert_close(grads[1], per_example[0][1] + per_example[1][1])
    assert_close(grads[2], jnp.stack([g[2] for g in per_example]))


def test_vmap_of_grad(small_inputs):
    q, k, v = small_inputs
    ks = jnp.stack([k, 0.5 * k, -k], axis=1)
    grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(None, 1, None))(q, ks, v)
    for i in range(3):
        assert_close([g[i] for g in grads], jax.grad(loss, argnums=(0, 1, 2))(q, ks[:, i], v))


def test_checkpoint(small_inputs):
    grads = jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(*small_inputs)
    assert_close(grads, jax.grad(loss, argnums=(0, 1, 2))(*small_inputs))


def test_rank3_inputs(small_inputs):
    q, k, v = (x[1] for x in small_inputs)
    lens = dict(query_seq_lengths=jnp.array([11], jnp.int32), key_value_seq_lengths=jnp.array([20], jnp.int32))
    out = jax_flash.dot_product_attention(q, k, v, is_causal=True, **lens)
    assert out.shape == q.shape
    assert_close(out, jax_flash.dot_product_attention(q[None], k[None], v[None], is_causal=True, **lens)[0])
    grads = jax.grad(lambda q, k, v: jnp.sum(jax_flash.dot_product_attention(q, k, v) ** 2), (0, 1, 2))(q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    out, residual = jax_flash.dot_product_attention(q, k, v, return_residual=True)
    assert residual.shape == q.shape[:-1]


def test_gradient_of_lengths_is_zero(small_inputs):
    q, k, v = small_inputs
    q_lens = jnp.array([17, 5], jnp.int32)
    grad = jax.grad(lambda q, q_lens: jnp.sum(attend(q, k, v, q_lens)), argnums=(0, 1), allow_int=True)(q, q_lens)
    assert grad[1].dtype == jax.dtypes.float0


def test_zero_sized_inputs():
    q = jnp.ones((2, 0, 4, 32), jnp.bfloat16)
    k = jnp.ones((2, 5, 2, 32), jnp.bfloat16)
    assert jax_flash.dot_product_attention(q, k, k).shape == q.shape
    q = jnp.ones((2, 5, 4, 32), jnp.bfloat16)
    k = jnp.ones((2, 0, 2, 32), jnp.bfloat16)
    out, residual = jax_flash.dot_product_attention(q, k, k, return_residual=True)
    assert not out.any() and jnp.all(residual == -jnp.inf)


# return_residual


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_residual_matches_jax_nn(dtype, attention_checks):
    case = attention_checks.Case(batch=2, seqlen_q=33, seqlen_k=47, heads_q=4, heads_kv=2, head_dim=64,
                                 is_causal=True, window=(9, 2), q_lens=(33, 20), kv_lens=(47, 0))
    q, k, v, _ = attention_checks.make_inputs(case, dtype)
    kwargs = case.kwargs()
    out, residual = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
        q, k, v, return_residual=True, **kwargs))(q, k, v)
    # jax.nn computes the residual in float32 and rounds it to the input dtype; upcast first so that float16
    # compiles on CPU.
    _, ref_residual = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, return_residual=True, implementation="xla", **kwargs))(*(x.astype(jnp.float32) for x in (q, k, v)))
    ref_residual = ref_residual.astype(dtype)
    assert residual.shape == ref_residual.shape == q.shape[:-1] and residual.dtype == dtype
    seen = case.row_sees_key()
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(residual, np.float64)[seen], np.asarray(ref_residual, np.float64)[seen],
                               rtol=4 * eps, atol=4 * eps)
    assert np.all(np.asarray(residual)[~seen] == -np.inf)
    np.testing.assert_array_equal(out, jax_flash.dot_product_attention(q, k, v, **kwargs))


def test_residual_is_stop_gradient(small_inputs):
    q, k, v = small_inputs
    grad = jax.grad(lambda q: jnp.sum(jax_flash.dot_product_attention(q, k, v, return_residual=True)[1]))(q)
    assert not grad.any()


# Validation.


def _arrays(dtype=jnp.float32, q_shape=(2, 8, 4, 32), kv_shape=(2, 8, 2, 32)):
    return jnp.ones(q_shape, dtype), jnp.ones(kv_shape, dtype), jnp.ones(kv_shape, dtype)


BAD_ARGUMENTS = {
    "rank2": (dict(query=jnp.ones((8, 32))), ValueError, "query must have rank 4"),
    "rank5": (dict(query=jnp.ones((1, 2, 8, 4, 32)), key=jnp.ones((1, 2, 8, 2, 32)),
                   value=jnp.ones((1, 2, 8, 2, 32))), ValueError, "query must have rank 4"),
    "key_rank": (dict(key=jnp.ones((8, 2, 32))), ValueError, "key must have the rank of query"),
    "value_shape": (dict(value=jnp.ones((2, 9, 2, 32))), ValueError, "value shape must equal key shape"),
    "batch": (dict(key=jnp.ones((3, 8, 2, 32)), value=jnp.ones((3, 8, 2, 32))), ValueError, "key batch size"),
    "head_dim_mismatch": (dict(key=jnp.ones((2, 8, 2, 40)), value=jnp.ones((2, 8, 2, 40))), ValueError,
                          "key head_dim"),
    "heads": (dict(key=jnp.ones((2, 8, 3, 32)), value=jnp.ones((2, 8, 3, 32))), ValueError,
              "query heads must be a multiple"),
    "key_dtype": (dict(key=jnp.ones((2, 8, 2, 32), jnp.bfloat16)), ValueError, "key dtype"),
    "value_dtype": (dict(value=jnp.ones((2, 8, 2, 32), jnp.float16)), ValueError, "value dtype"),
    "int_dtype": (dict(zip(("query", "key", "value"), _arrays(jnp.int32))), TypeError,
                  "must be bfloat16, float16 or float32, got int32"),
    "head_dim_large": (dict(zip(("query", "key", "value"), _arrays(q_shape=(2, 8, 4, 264),
                                                                  kv_shape=(2, 8, 2, 264)))),
                       ValueError, "head_dim .* got 264"),
    "head_dim_odd": (dict(zip(("query", "key", "value"), _arrays(q_shape=(2, 8, 4, 20), kv_shape=(2, 8, 2, 20)))),
                     ValueError, "head_dim .* got 20"),
    "q_lens_shape": (dict(query_seq_lengths=jnp.array([8, 8, 8], jnp.int32)), ValueError,
                     r"query_seq_lengths must be an int32 array of shape \(batch,\) = \(2,\), got shape \(3,\)"),
    "q_lens_rank": (dict(query_seq_lengths=jnp.array([[8, 8]], jnp.int32)), ValueError, "query_seq_lengths"),
    "kv_lens_dtype": (dict(key_value_seq_lengths=jnp.array([8, 8], jnp.float32)), ValueError,
                      "key_value_seq_lengths .* dtype float32"),
    "kv_lens_uint": (dict(key_value_seq_lengths=np.array([8, 8], np.uint32)), ValueError,
                     "key_value_seq_lengths .* dtype uint32"),
    "window_negative": (dict(local_window_size=(-1, 3)), ValueError, "local_window_size must be >= 0"),
    "window_int_negative": (dict(local_window_size=-2), ValueError, "local_window_size must be >= 0"),
    "window_triple": (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
    "window_float": (dict(local_window_size=2.5), TypeError, "local_window_size"),
    "causal_int": (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    "causal_str": (dict(is_causal="yes"), TypeError, "is_causal must be a bool"),
    "deterministic_int": (dict(deterministic=1), TypeError, "deterministic must be a bool, got int"),
    "residual_str": (dict(return_residual="no"), TypeError, "return_residual must be a bool, got str"),
    "scale_nan": (dict(scale=float("nan")), ValueError, "scale must be finite"),
    "scale_inf": (dict(scale=float("inf")), ValueError, "scale must be finite"),
    "scale_str": (dict(scale="0.5"), TypeError, "scale must be a static Python float"),
    "scale_huge": (dict(scale=3e38), ValueError, r"scale \* log2\(e\) must fit a float32 .* got 3e\+38"),
    "implementation": (dict(implementation="triton"), ValueError, "implementation must be None, 'xla' or 'cudnn'"),
    "mask_shape": (dict(mask=jnp.ones((3, 3), bool)), ValueError,
                   r"mask must broadcast to \(batch, heads, query rows, keys\) = \(2, 4, 8, 8\), got shape \(3, 3\)"),
    "bias_rank": (dict(bias=jnp.ones((1, 2, 4, 8, 8))), ValueError, "bias must broadcast to"),
    "mask_integer_inputs": (dict(query=jnp.ones((2, 8, 4, 32), jnp.int32), key=jnp.ones((2, 8, 2, 32), jnp.int32),
                                 value=jnp.ones((2, 8, 2, 32), jnp.int32), mask=jnp.ones((8, 8), bool)), TypeError,
                            "must be floating-point, got int32"),
}


@pytest.mark.parametrize("name", BAD_ARGUMENTS)
def test_bad_arguments(name):
    changes, error, match = BAD_ARGUMENTS[name]
    args = dict(zip(("query", "key", "value"), _arrays()))
    args.update(changes)
    with pytest.raises(error, match=match):
        jax_flash.dot_product_attention(**args)


def test_bad_arguments_under_jit():
    q, k, v = _arrays()
    with pytest.raises(ValueError, match="query_seq_lengths"):
        jax.jit(lambda q, n: jax_flash.dot_product_attention(q, k, v, query_seq_lengths=n))(q, jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="scale must be a static Python float"):
        jax.jit(lambda q, s: jax_flash.dot_product_attention(q, k, v, scale=s))(q, 0.5)


def test_float64_rejected():
    with jax.enable_x64(True):
        q, k, v = _arrays(jnp.float64)
        with pytest.raises(TypeError, match="got float64"):
            jax_flash.dot_product_attention(q, k, v)
        q, k, v = _arrays()
        with pytest.raises(ValueError, match="query_seq_lengths .* dtype int64"):
            jax_flash.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([8, 8]))


# Delegation and fallbacks.


@pytest.mark.parametrize("implementation", ["xla"])
def test_explicit_implementation_delegates_to_jax_nn(implementation, small_inputs):
    q, k, v = small_inputs
    kwargs = dict(is_causal=True, local_window_size=(3, 1), implementation=implementation, return_residual=True)
    np.testing.assert_array_equal(jax_flash.dot_product_attention(q, k, v, **kwargs)[0],
                                  jax.nn.dot_product_attention(q, k, v, **kwargs)[0])
    text = jax.jit(lambda q: jax_flash.dot_product_attention(q, k, v, **kwargs)).lower(q).as_text()
    assert "jax_flash_fwd" not in text


@pytest.mark.parametrize("name", ["mask", "bias"])
def test_dense_mask_or_bias_falls_back_and_warns_once(name, small_inputs, fresh_warnings):
    q, k, v = small_inputs
    arrays = dict(mask=jnp.tril(jnp.ones((1, 1, 17, 23), bool)), bias=jnp.linspace(-1, 1, 17 * 23).reshape(17, 23))
    extra = {name: arrays[name][None, None] if name == "bias" else arrays[name]}
    with pytest.warns(RuntimeWarning, match=f"no dense {name}"):
        out = jax_flash.dot_product_attention(q, k, v, **extra)
    np.testing.assert_array_equal(out, jax.nn.dot_product_attention(q, k, v, implementation="xla", **extra))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax_flash.dot_product_attention(q, k, v, **extra)
        jax.grad(lambda q: jnp.sum(jax_flash.dot_product_attention(q, k, v, **extra)))(q)


def test_no_warning_on_the_kernel_path(small_inputs, fresh_warnings):
    if any(p != "cuda" for p in attention_module._present_accelerators()) or (
            attention_module._present_accelerators() and not jax_flash.cuda_available()):
        pytest.skip("a backend without jax_flash kernels is present: a warning is due")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)))(
            *(x.astype(jnp.bfloat16) for x in small_inputs))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_xla_fallback_branch(dtype, small_inputs):
    """The branch run on platforms without a kernel matches jax.nn, forward and backward."""
    q, k, v = (x.astype(dtype) for x in small_inputs)
    lens = jnp.array([17, 4], jnp.int32), jnp.array([23, 11], jnp.int32)
    cfg = attention_module._Config(scale=0.2, is_causal=True, window=(5, 2), kernel_platforms=())
    kwargs = dict(scale=0.2, is_causal=True, local_window_size=(5, 2), query_seq_lengths=lens[0],
                  key_value_seq_lengths=lens[1], implementation="xla")

    def ours(q, k, v):
        return attention_module._flash_attention(cfg, q, k, v, *lens, None, None, None)[0]

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, **kwargs)

    text = jax.jit(ours).lower(q, k, v).as_text()
    assert "jax_flash_fwd" not in text
    assert_close(jax.jit(ours)(q, k, v), theirs(q, k, v))
    g = jax.grad(lambda *a: jnp.sum(ours(*a).astype(jnp.float32) ** 2), (0, 1, 2))(q, k, v)
    g_ref = jax.grad(lambda *a: jnp.sum(theirs(*a).astype(jnp.float32) ** 2), (0, 1, 2))(q, k, v)
    assert_close([x.astype(jnp.float32) for x in g], [x.astype(jnp.float32) for x in g_ref])


def test_deterministic_backward_on_cpu(attention_checks):
    """deterministic=True is accepted; the CPU backward is reproducible either way, so both agree bitwise."""
    case = attention_checks.Case(batch=2, seqlen_q=97, seqlen_k=130, heads_q=4, heads_kv=2, head_dim=64,
                                 is_causal=True)
    q, k, v, do = attention_checks.make_inputs(case, jnp.bfloat16, seed=5)
    runs = [attention_checks.fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, deterministic=d, **case.kwargs())
            for d in (True, True, False)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
    assert np.abs(runs[0][1]).max() > 0  # dq is not trivially zero
