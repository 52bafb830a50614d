"""Position offsets of the kernel interface (jax_flash._ffi): a call that holds a part of a longer sequence (rows
from q_offset, keys from kv_offset; sharding and ring attention) applies causal, window and length masks at global
positions. Checked on the CPU kernel against a float64 reference of the whole sequence: the forward of a part of the
queries over a part of the keys; parts of the keys merged through their log-sum-exps give the whole attention; and
the backward of a key part, given the whole attention's O and log-sum-exp, gives that part's dK, dV and its share of
dQ."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi

B, SQ, SK, HQ, HKV, D = 2, 37, 41, 4, 2, 32


def _visible(is_causal, window, q_lens, kv_lens):
    """Bool [B, 1, SQ, SK] at global positions."""
    i = np.arange(SQ)[:, None]
    j = np.arange(SK)[None, :]
    mask = np.ones((B, 1, SQ, SK), bool)
    if is_causal:
        mask &= j <= i
    if window is not None:
        mask &= (i - window[0] <= j) & (j <= i + window[1])
    mask &= i < np.array(q_lens)[:, None, None, None]
    mask &= j < np.array(kv_lens)[:, None, None, None]
    return mask


def _reference(q, k, v, do, visible, scale):
    """(o, lse [B, H, SQ], dq, dk, dv) in float64 over the visible pairs; rows that see nothing: 0, lse +inf."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    g = HQ // HKV
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.where(visible, scale * np.einsum("bthd,bshd->bhts", q, kr), -np.inf)
    m = s.max(-1, keepdims=True)
    w = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = w.sum(-1, keepdims=True)
    p = w / np.where(l > 0, l, 1)
    o = np.einsum("bhts,bshd->bthd", p, vr)
    sees = l[..., 0] > 0
    lse = np.where(sees, np.log(np.where(sees, l[..., 0], 1)) + np.where(np.isfinite(m), m, 0)[..., 0], np.inf)
    dp = np.einsum("bthd,bshd->bhts", do, vr)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = scale * np.einsum("bhts,bshd->bthd", ds, kr)
    dk = scale * np.einsum("bhts,bthd->bshd", ds, q).reshape(B, SK, HKV, g, D).sum(3)
    dv = np.einsum("bhts,bthd->bshd", p, do).reshape(B, SK, HKV, g, D).sum(3)
    return o, lse, dq, dk, dv


MASKS = {
    "none": dict(is_causal=False, window=None),
    "causal": dict(is_causal=True, window=None),
    "window": dict(is_causal=False, window=(5, 3)),
    "causal_window": dict(is_causal=True, window=(9, 0)),
}


# (device, dtype, tolerance relative to the reference's largest value): the CPU kernel in float32, the CUDA kernels
# (the sm_90a ones on compute capability 9.0) in bfloat16.
PLATFORMS = [
    pytest.param("cpu", np.float32, 2e-5, id="cpu"),
    pytest.param("gpu", jnp.bfloat16, 3e-2, id="gpu", marks=pytest.mark.gpu),
]


def _device(platform):
    if platform == "gpu" and not jax_flash.cuda_available():
        pytest.skip("needs a CUDA GPU and jax_flash's CUDA kernels")
    return jax.devices(platform)[0]


def _inputs(seed, dtype=np.float32):
    """q, k, v, do as float32 numpy values representable in `dtype`."""
    rng = np.random.default_rng(seed)
    return [np.asarray(jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dtype).astype(jnp.float32))
            for s in ((B, SQ, HQ, D), (B, SK, HKV, D), (B, SK, HKV, D), (B, SQ, HQ, D))]


def _close(x, ref, tol):
    x = np.asarray(x, np.float64)
    finite = np.isfinite(ref)
    assert (np.isfinite(x) == finite).all()
    np.testing.assert_allclose(x[finite], ref[finite], atol=tol * max(np.abs(ref[finite]).max(), 1), rtol=0)


def _attrs(is_causal, window, scale):
    left, right = window if window is not None else (-1, -1)
    return dict(scale=scale, is_causal=is_causal, window_left=left, window_right=right)


def _i32(values, device=None):
    return jax.device_put(np.array(values, np.int32), device)


@pytest.mark.parametrize("platform, dtype, tol", PLATFORMS)
@pytest.mark.parametrize("mask", list(MASKS))
def test_forward_of_a_part_uses_global_positions(mask, platform, dtype, tol):
    dev = _device(platform)
    is_causal, window = MASKS[mask]["is_causal"], MASKS[mask]["window"]
    q, k, v, do = _inputs(0, dtype)
    put = lambda x: jax.device_put(jnp.asarray(x, dtype), dev)
    i32 = lambda x: _i32(x, dev)
    q_lens, kv_lens = (37, 30), (41, 25)
    scale = 0.3
    a, b, c, d = 11, 29, 7, 33  # rows [a, b), keys [c, d)
    part = np.zeros((B, 1, SQ, SK), bool)
    part[..., c:d] = True
    ref_o, ref_lse, *_ = _reference(q, k, v, do, _visible(is_causal, window, q_lens, kv_lens) & part, scale)
    o, lse = _ffi.flash_fwd(put(q[:, a:b]), put(k[:, c:d]), put(v[:, c:d]), i32(q_lens), i32(kv_lens), i32([a, a]),
                            i32([c, c]), **_attrs(is_causal, window, scale))
    _close(o, ref_o[:, a:b], tol)
    _close(lse, ref_lse[:, :, a:b], tol)


@pytest.mark.parametrize("platform, dtype, tol", PLATFORMS)
@pytest.mark.parametrize("mask", list(MASKS))
def test_key_parts_merge_to_the_whole_and_backward_takes_the_global_residuals(mask, platform, dtype, tol):
    dev = _device(platform)
    is_causal, window = MASKS[mask]["is_causal"], MASKS[mask]["window"]
    q, k, v, do = _inputs(1, dtype)
    put = lambda x: jax.device_put(jnp.asarray(x, dtype), dev)
    i32 = lambda x: _i32(x, dev)
    q_lens, kv_lens = (37, 20), (41, 35)
    scale = 0.25
    ref_o, ref_lse, ref_dq, ref_dk, ref_dv = _reference(q, k, v, do, _visible(is_causal, window, q_lens, kv_lens),
                                                        scale)
    attrs = _attrs(is_causal, window, scale)
    zeros = i32([0, 0])
    parts = [(0, 13), (13, 30), (30, 41)]
    outs, lses = [], []
    for c, d in parts:
        o, lse = _ffi.flash_fwd(put(q), put(k[:, c:d]), put(v[:, c:d]), i32(q_lens), i32(kv_lens), zeros,
                                i32([c, c]), **attrs)
        outs.append(np.asarray(o, np.float64))
        lses.append(np.asarray(lse, np.float64))
    # Merge: weights exp(lse_part - lse) (rows a part does not reach have lse +inf there: weight 0).
    finite = [np.where(np.isfinite(x), x, -np.inf) for x in lses]
    total = np.logaddexp.reduce(finite, axis=0)
    with np.errstate(invalid="ignore"):  # -inf - -inf where no part reaches the row
        weights = [np.exp(np.where(np.isfinite(total), f - total, -np.inf)) for f in finite]
    merged = sum(w[..., None].swapaxes(1, 2) * o for w, o in zip(weights, outs))
    _close(merged, ref_o, tol)
    _close(np.where(np.isfinite(total), total, np.inf), ref_lse, tol)

    o_g = put(ref_o)
    lse_g = jax.device_put(jnp.asarray(ref_lse, jnp.float32), dev)
    dq = np.zeros_like(ref_dq)
    for c, d in parts:
        dq_part, dk, dv = _ffi.flash_bwd(put(q), put(k[:, c:d]), put(v[:, c:d]), o_g, lse_g, put(do), i32(q_lens),
                                         i32(kv_lens), zeros, i32([c, c]), **attrs)
        dq += np.asarray(dq_part, np.float64)
        _close(dk, ref_dk[:, c:d], 2 * tol)
        _close(dv, ref_dv[:, c:d], 2 * tol)
    _close(dq, ref_dq, 2 * tol)


def test_offsets_with_the_wrong_shape_are_refused():
    q, k, v, _ = (jnp.asarray(x) for x in _inputs(2))
    with pytest.raises(Exception, match="q_offsets/kv_offsets must hold one position per batch element"):
        jax.block_until_ready(_ffi.flash_fwd(q, k, v, _i32([SQ, SQ]), _i32([SK, SK]), _i32([0, 0, 0]), _i32([0, 0]),
                                             **_attrs(False, None, 0.2)))
