"""The FFI layer: loading the extension, target registration, the custom calls in lowered HLO, and the raw fwd/bwd
calls."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi

ATTRS = dict(scale=0.25, is_causal=False, window_left=-1, window_right=-1)


def inputs(dtype=jnp.float32, batch=(2,), seqlen_q=9, seqlen_k=12, heads_q=4, heads_kv=2, head_dim=16):
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (*batch, seqlen_q, heads_q, head_dim), dtype)
    k = jax.random.normal(keys[1], (*batch, seqlen_k, heads_kv, head_dim), dtype)
    v = jax.random.normal(keys[2], (*batch, seqlen_k, heads_kv, head_dim), dtype)
    return q, k, v


def attend(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, is_causal=True)


def test_registration_state():
    assert isinstance(jax_flash.cuda_available(), bool)
    assert _ffi.CUDA_REGISTERED == (not _ffi.CUDA_UNAVAILABLE_REASON)
    if not _ffi.CUDA_REGISTERED:
        assert not jax_flash.cuda_available()
    assert isinstance(jax_flash.__version__, str)


def test_forward_hlo_has_only_the_forward_call():
    text = jax.jit(attend).lower(*inputs()).as_text()
    assert "@jax_flash_fwd" in text
    assert "@jax_flash_bwd" not in text


def test_gradient_hlo_has_both_calls():
    grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2))
    text = jax.jit(grad).lower(*inputs()).as_text()
    assert "@jax_flash_fwd" in text and "@jax_flash_bwd" in text


def test_compiled_cpu_executable_calls_the_target():
    text = jax.jit(attend).lower(*inputs()).compile().as_text()
    assert "jax_flash_fwd" in text


def test_absent_operands_cost_no_kernel():
    """The stand-ins for absent sinks, segment ids and page tables, shape (batch, 1), and the lengths of a call given
    none, shape (batch,), enter the compiled program as constants: not as broadcasts, which XLA makes of a constant
    of equal elements and runs as kernels before every call. (The zero offsets, which the kernels read, stay one.)"""
    grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2))
    decode = lambda q, k, v: jax_flash.decode_attention(q[:, :1], k, v, jnp.array([5, 12], jnp.int32))  # noqa: E731
    for fn in (attend, grad, decode):
        text = jax.jit(fn).lower(*inputs()).compile().as_text()
        made = re.findall(r"= ([fs]32\[2,1\])\S* (fusion|broadcast)\(", text)
        assert not made, made
        if fn is not decode:  # the lengths (9 rows, 12 keys) and the offsets: one broadcast, the offsets'
            made = re.findall(r"= (s32\[2\])\S* (fusion|broadcast)\((%constant[.\d]*)\)", text)
            assert len(made) <= 1, made


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_lowering_for_cuda(dtype):
    """float32 runs jax.nn's xla path on CUDA; half precision runs the kernel when the CUDA targets exist."""
    grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    text = jax.jit(grad).trace(*inputs(dtype)).lower(lowering_platforms=("cuda",)).as_text()
    expect_kernel = dtype != jnp.float32 and _ffi.CUDA_REGISTERED
    assert ("@jax_flash_fwd" in text) == expect_kernel
    assert ("@jax_flash_bwd" in text) == expect_kernel


def test_lowering_for_tpu_uses_xla():
    text = jax.jit(attend).trace(*inputs(jnp.bfloat16)).lower(lowering_platforms=("tpu",)).as_text()
    assert "@jax_flash_fwd" not in text


def test_forward_lse_and_empty_rows():
    q, k, v = inputs()
    q_lens = jnp.array([9, 5], jnp.int32)
    kv_lens = jnp.array([12, 0], jnp.int32)
    o, lse = _ffi.flash_fwd(q, k, v, q_lens, kv_lens, **ATTRS)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (2, 4, 9) and lse.dtype == jnp.float32
    logits = 0.25 * jnp.einsum("tnh,snh->nts", q[0], jnp.repeat(k[0], 2, axis=1))
    np.testing.assert_allclose(lse[0], jax.nn.logsumexp(logits, axis=-1), rtol=1e-5, atol=1e-5)
    assert jnp.all(lse[1] == jnp.inf) and not o[1].any()


def test_backward_shapes():
    q, k, v = inputs(jnp.bfloat16)
    lens = jnp.array([9, 9], jnp.int32), jnp.array([12, 12], jnp.int32)
    o, lse = _ffi.flash_fwd(q, k, v, *lens, **ATTRS)
    dq, dk, dv = _ffi.flash_bwd(q, k, v, o, lse, jnp.ones_like(o), *lens, **ATTRS)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == jnp.bfloat16


def test_backward_workspaces_are_padded_and_checked():
    """The backward's workspaces: row statistics [..., Hq, 2, Sq rounded up to 128] and the dQ accumulator [..., Hq,
    Sq rounded up to 128, head-dim class]; the handler names a workspace of the wrong shape."""
    assert _ffi._row_stats_workspace_shape((2, 9, 4, 16)) == (2, 4, 2, 128)
    assert _ffi._row_stats_workspace_shape((3, 2, 256, 4, 64)) == (3, 2, 4, 2, 256)
    assert _ffi._dq_accum_workspace_shape((2, 130, 4, 72)) == (2, 4, 256, 128)
    assert _ffi._dq_accum_workspace_shape((130, 4, 200)) == (4, 256, 256)
    assert _ffi._dq_accum_workspace_shape((1, 128, 1, 64)) == (1, 1, 128, 64)
    q, k, v = inputs()
    lens = jnp.array([9, 9], jnp.int32), jnp.array([12, 12], jnp.int32)
    o, lse = _ffi.flash_fwd(q, k, v, *lens, **ATTRS)
    call = jax.ffi.ffi_call(
        _ffi.BWD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct(q.shape, jnp.float32),  # the unpadded [..., Sq, Hq, D]: wrong
         jax.ShapeDtypeStruct(_ffi._row_stats_workspace_shape(q.shape), jnp.float32),
         jax.ShapeDtypeStruct(_ffi._row_stats_shape(q.shape), jnp.int32)))
    operands = (q, k, v, o, lse, jnp.ones_like(o), *lens, jnp.zeros_like(lens[0]), jnp.zeros_like(lens[1]),
                *_ffi._segment_operands(q, k, None, None))
    attrs = _ffi._attrs(ATTRS["scale"], False, -1, -1, None, False)
    with pytest.raises(Exception, match=r"dq_accum has shape \(2, 9, 4, 16\), expected \(2, 4, 128, 64\)"):
        jax.block_until_ready(call(*operands, deterministic=False, **attrs))


def test_leading_dims_fold_into_batch():
    """Extra leading dims (as vmap's broadcast_all adds) are folded into the batch by the handlers."""
    q, k, v = inputs(batch=(3, 2))
    q_lens = jnp.array([[9, 4], [1, 9], [0, 7]], jnp.int32)
    kv_lens = jnp.array([[12, 3], [12, 12], [5, 0]], jnp.int32)
    o, lse = _ffi.flash_fwd(q, k, v, q_lens, kv_lens, **ATTRS)
    assert lse.shape == (3, 2, 4, 9)
    for i in range(3):
        o_i, lse_i = _ffi.flash_fwd(q[i], k[i], v[i], q_lens[i], kv_lens[i], **ATTRS)
        np.testing.assert_array_equal(o[i], o_i)
        np.testing.assert_array_equal(lse[i], lse_i)


def test_vmap_broadcasts_unbatched_arguments():
    q, k, v = inputs()
    lens = jnp.array([9, 6], jnp.int32), jnp.array([12, 7], jnp.int32)
    qs = jnp.stack([q, 2 * q])
    o, lse = jax.vmap(lambda q: _ffi.flash_fwd(q, k, v, *lens, **ATTRS))(qs)
    assert o.shape == qs.shape and lse.shape == (2, 2, 4, 9)
    np.testing.assert_array_equal(o[1], _ffi.flash_fwd(2 * q, k, v, *lens, **ATTRS)[0])


@pytest.mark.parametrize("scale", [0.0, -0.5, 1e-40, float("nan")])
def test_handler_rejects_a_scale_the_kernels_cannot_take(scale):
    q, k, v = inputs()
    lens = jnp.array([9, 9], jnp.int32)
    with pytest.raises(Exception, match="scale must be finite and > 0 with scale \\* log2\\(e\\) a normal float32"):
        jax.block_until_ready(_ffi.flash_fwd(q, k, v, lens, lens, **{**ATTRS, "scale": scale}))


def test_handler_rejects_bad_lengths():
    q, k, v = inputs()
    bad = jnp.array([9, 9, 9], jnp.int32)
    with pytest.raises(Exception, match="jax_flash: query_seq_lengths/key_value_seq_lengths"):
        jax.block_until_ready(_ffi.flash_fwd(q, k, v, bad, bad, **ATTRS))


def test_export_for_several_platforms_runs_on_cpu():
    """One exported function carries the kernel for CPU and CUDA and jax.nn's path for TPU; CPU runs its branch."""
    args = inputs(jnp.bfloat16)
    unchecked = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (_ffi.FWD_TARGET, _ffi.BWD_TARGET)]
    exported = jax.export.export(jax.jit(attend), platforms=("cpu", "cuda", "tpu"), disabled_checks=unchecked)(*args)
    text = exported.mlir_module()
    assert "@jax_flash_fwd" in text
    np.testing.assert_array_equal(exported.call(*args), attend(*args))


def test_cpu_only_install_says_so(monkeypatch, caplog):
    monkeypatch.setattr(_ffi, "CUDA_REGISTERED", False)
    monkeypatch.setattr(_ffi, "CUDA_UNAVAILABLE_REASON", "the CUDA kernels are not built (CPU-only install)")
    with caplog.at_level("WARNING", logger="jax_flash"):
        jax_flash._report_cuda_status()
    assert "CPU-only install" in caplog.text and "only the CPU kernels" in caplog.text
    assert not jax_flash.cuda_available()


def test_import_without_the_extension_says_what_to_do(tmp_path):
    """The source tree's jax_flash (no compiled extension), found first on sys.path as from the repository root,
    fails with an ImportError that says what happened and what to do, not a confusing circular-import error."""
    source = pathlib.Path(__file__).resolve().parent.parent / "jax_flash"
    (tmp_path / "jax_flash").mkdir()
    for path in source.glob("*.py"):
        shutil.copy(path, tmp_path / "jax_flash")
    result = subprocess.run([sys.executable, "-c", "import jax_flash"], capture_output=True, text=True,
                            cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: jax_flash's compiled extension _jax_flash_cpu is missing from "
                           f"{tmp_path / 'jax_flash'}"), result.stderr
    assert "`pip install .`" in last and "`pytest` command" in last
    assert "circular import" not in result.stderr
