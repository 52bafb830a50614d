"""jax_flash.reference_attention against a direct numpy loop and against jax.nn.dot_product_attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

CASES = {
    "plain": dict(batch=2, seqlen_q=7, seqlen_k=11, heads_q=2, heads_kv=2, head_dim=8),
    "gqa_causal": dict(batch=1, seqlen_q=11, seqlen_k=7, heads_q=6, heads_kv=2, head_dim=8, is_causal=True),
    "window": dict(batch=1, seqlen_q=9, seqlen_k=13, heads_q=2, heads_kv=1, head_dim=8, window=(2, 3)),
    "window_int_causal": dict(batch=1, seqlen_q=9, seqlen_k=9, heads_q=2, heads_kv=2, head_dim=8, is_causal=True,
                              window=2),
    "lengths": dict(batch=3, seqlen_q=6, seqlen_k=8, heads_q=2, heads_kv=2, head_dim=8, q_lens=(6, 2, 0),
                    kv_lens=(8, 0, 3)),
    "everything": dict(batch=2, seqlen_q=12, seqlen_k=9, heads_q=4, heads_kv=1, head_dim=8, is_causal=True,
                       window=(3, 1), q_lens=(10, 12), kv_lens=(9, 4)),
}


def numpy_attention(q, k, v, scale, is_causal, window, q_lens, kv_lens):
    """Attention row by row from the definition, in float64; rows that see no key are 0."""
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    left, right = (window, window) if isinstance(window, int) else (window or (None, None))
    out = np.zeros(q.shape)
    for b, h, i in np.ndindex(batch, heads_q, seqlen_q):
        if q_lens is not None and i >= q_lens[b]:
            continue
        keys = [j for j in range(seqlen_k)
                if (not is_causal or j <= i) and (left is None or i - left <= j <= i + right)
                and (kv_lens is None or j < kv_lens[b])]
        if not keys:
            continue
        kh = h // (heads_q // heads_kv)
        logits = np.array([scale * q[b, i, h] @ k[b, j, kh] for j in keys])
        p = np.exp(logits - logits.max())
        out[b, i, h] = (p / p.sum()) @ v[b, keys, kh]
    return out


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_numpy_loop(case, attention_checks):
    c = attention_checks.Case(**case)
    q, k, v, _ = (np.asarray(x, np.float64) for x in attention_checks.make_inputs(c, jnp.float32))
    expected = numpy_attention(q, k, v, 1 / np.sqrt(c.head_dim), c.is_causal, c.window, c.q_lens, c.kv_lens)
    with jax.enable_x64(True):
        out = jax.jit(functools.partial(jax_flash.reference_attention, **c.kwargs()))(q, k, v)
        assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_numpy_reference_gradients_match_autodiff(case, attention_checks):
    """The tests' hand-differentiated numpy reference against reference_attention differentiated by JAX."""
    c = attention_checks.Case(**case)
    args = attention_checks.make_inputs(c, jnp.float32)
    expected = attention_checks.numpy_reference(c, *args)
    with jax.enable_x64(True):
        got = attention_checks.fwd_bwd(jax_flash.reference_attention, *(jnp.asarray(x, jnp.float64) for x in args),
                                       **c.kwargs())
    for x, y in zip(got, expected):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_jax_nn_where_semantics_agree(case, attention_checks):
    c = attention_checks.Case(**case)
    q, k, v, do = attention_checks.make_inputs(c, jnp.float32)
    agree = c.rows_like_jax_nn()
    do = do * jnp.asarray(agree, do.dtype)[:, :, None, None]
    kwargs = c.kwargs()
    ours = attention_checks.fwd_bwd(jax_flash.reference_attention, q, k, v, do, **kwargs)
    theirs = attention_checks.fwd_bwd(functools.partial(jax.nn.dot_product_attention, implementation="xla"),
                                      q, k, v, do, **kwargs)
    np.testing.assert_allclose(ours[0][agree], theirs[0][agree], rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(ours[1:], theirs[1:]):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)


def test_rank3_and_dtype(attention_checks):
    c = attention_checks.Case(batch=1, seqlen_q=5, seqlen_k=6, heads_q=2, heads_kv=1, head_dim=8)
    q, k, v, _ = attention_checks.make_inputs(c, jnp.bfloat16)
    reference = jax.jit(jax_flash.reference_attention)
    out = reference(q[0].astype(jnp.float32), k[0].astype(jnp.float32), v[0])
    assert out.shape == q.shape[1:] and out.dtype == jnp.float32
    np.testing.assert_allclose(out, reference(q.astype(jnp.float32), k, v)[0], rtol=1e-6)


def test_fully_masked_rows_have_zero_gradients():
    q = k = v = jnp.ones((1, 4, 1, 8))
    grads = jax.grad(lambda q, k, v: jnp.sum(jax_flash.reference_attention(
        q, k, v, key_value_seq_lengths=jnp.zeros(1, jnp.int32))), (0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(g).all() and not g.any()
