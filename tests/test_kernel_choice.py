"""jax_flash.force_kernel and the ``kernel`` FFI attribute: the CUDA kernel family is chosen per call (at trace
time), so one process can test both the sm_90a and the sm_80-class kernels; bad values are refused by Python and
again by the C++ handlers."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi


def test_force_kernel_rejects_unknown_names():
    with pytest.raises(ValueError, match="kernel must be one of"):
        with jax_flash.force_kernel("sm90"):
            pass


def test_kernel_attribute_follows_context_then_environment(monkeypatch):
    monkeypatch.delenv("JAX_FLASH_FORCE_SM80", raising=False)
    assert _ffi._kernel_choice() == 0
    monkeypatch.setenv("JAX_FLASH_FORCE_SM80", "1")
    assert _ffi._kernel_choice() == 1  # read at each call, not cached
    monkeypatch.setenv("JAX_FLASH_FORCE_SM80", "small-smem")
    assert _ffi._kernel_choice() == 2
    with jax_flash.force_kernel("auto"):  # the context wins over the environment
        assert _ffi._kernel_choice() == 0
        with jax_flash.force_kernel("sm80"):
            assert _ffi._kernel_choice() == 1
        assert _ffi._kernel_choice() == 0
    monkeypatch.setenv("JAX_FLASH_FORCE_SM80", "0")
    assert _ffi._kernel_choice() == 0


def test_cpu_ignores_the_choice(attention_checks):
    case = attention_checks.Case(batch=1, seqlen_q=33, seqlen_k=47, heads_q=4, heads_kv=2, head_dim=32,
                                 is_causal=True)
    q, k, v, do = attention_checks.make_inputs(case, jnp.float32)
    auto = attention_checks.fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, **case.kwargs())
    with jax_flash.force_kernel("sm80-small-smem"):
        forced = attention_checks.fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, **case.kwargs())
    for a, b in zip(auto, forced):
        np.testing.assert_array_equal(a, b)


def _raw_forward_without_options(platform, *, kernel=0, counter_shape=(1, 1)):
    """Calls the forward target itself on a (1, 8, 2, 64) query (as key and value) without segment ids or sinks."""
    if platform == "gpu" and not jax_flash.cuda_available():
        pytest.skip("needs a CUDA GPU and jax_flash's CUDA kernels")
    device = jax.devices(platform)[0]
    q = jax.device_put(jnp.ones((1, 8, 2, 64), jnp.bfloat16), device)
    lens = jax.device_put(jnp.full((1,), 8, jnp.int32), device)
    call = jax.ffi.ffi_call(_ffi.FWD_TARGET, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                              jax.ShapeDtypeStruct((1, 2, 8), jnp.float32),
                                              jax.ShapeDtypeStruct(counter_shape, jnp.int32)))
    none_i, none_f = (jax.device_put(jnp.zeros((1, 1), t), device) for t in (jnp.int32, jnp.float32))
    return jax.block_until_ready(call(q, q, q, lens, lens, 0 * lens, 0 * lens, *[none_i] * 6, none_f,
                                      scale=np.float32(0.125), is_causal=False, window_left=np.int64(-1),
                                      window_right=np.int64(-1), softcap=np.float32(0), has_segments=False,
                                      has_sinks=False, kernel=np.int32(kernel)))


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_handler_rejects_an_unknown_kernel_attribute(platform):
    with pytest.raises(Exception, match="kernel must be 0"):
        _raw_forward_without_options(platform, kernel=7)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_handler_rejects_a_bad_work_counter(platform):
    """The forward's work-counter workspace must be [..., 1] (the sm_90a launcher zeroes its first int)."""
    with pytest.raises(Exception, match=r"forward work counter has shape \(1, 0\), expected \(1, 1\)"):
        _raw_forward_without_options(platform, counter_shape=(1, 0))


BAD_OPERANDS = {
    "q_segment_ids": (dict(q_seg=(1, 7)), "q_segment_ids has shape (1, 7), expected batch x seqlen_q = 8"),
    "kv_segment_meta": (dict(kv_meta=(1, 1, 3)), "kv_segment_meta has shape (1, 1, 3)"),
    "q_segment_runs": (dict(q_runs=(1, 8)), "q_segment_runs has shape (1, 8), expected batch x seqlen_q x 2 = 16"),
    "sinks": (dict(sinks=(1, 3)), "sinks has shape (1, 3), expected batch x heads_q = 2"),
    "softcap": (dict(softcap=-1.0), "logits_soft_cap must be finite and > 0"),
    "softcap_subnormal": (dict(softcap=1e-40), "logits_soft_cap must be finite and > 0 (0: none), a normal float32"),
    "softcap_scale": (dict(softcap=1e38), "logits_soft_cap / scale out of float32 range"),
}


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("name", BAD_OPERANDS)
def test_handler_rejects_bad_option_operands(platform, name):
    """The forward handler checks the segment-id, metadata, runs and sinks operands and the soft cap itself (a caller
    of the raw target gets an error, never a read out of bounds)."""
    if platform == "gpu" and not jax_flash.cuda_available():
        pytest.skip("needs a CUDA GPU and jax_flash's CUDA kernels")
    device = jax.devices(platform)[0]
    bad, message = BAD_OPERANDS[name]
    q = jax.device_put(jnp.ones((1, 8, 2, 64), jnp.bfloat16), device)
    lens = jax.device_put(jnp.full((1,), 8, jnp.int32), device)
    shapes = dict(q_seg=(1, 8), kv_seg=(1, 8), q_meta=(1, 1, 4), kv_meta=(1, 1, 4), q_runs=(1, 8, 2),
                  kv_runs=(1, 8, 2), sinks=(1, 2))
    shapes.update({n: x for n, x in bad.items() if n != "softcap"})
    ops = [jax.device_put(jnp.zeros(shapes[n], jnp.float32 if n == "sinks" else jnp.int32), device)
           for n in ("q_seg", "kv_seg", "q_meta", "kv_meta", "q_runs", "kv_runs", "sinks")]
    call = jax.ffi.ffi_call(_ffi.FWD_TARGET, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                              jax.ShapeDtypeStruct((1, 2, 8), jnp.float32),
                                              jax.ShapeDtypeStruct((1, 1), jnp.int32)))
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        jax.block_until_ready(call(q, q, q, lens, lens, 0 * lens, 0 * lens, *ops, scale=np.float32(0.125),
                                   is_causal=False, window_left=np.int64(-1), window_right=np.int64(-1),
                                   softcap=np.float32(bad.get("softcap", 0.0)), has_segments=True, has_sinks=True,
                                   kernel=np.int32(0)))


@pytest.mark.gpu
def test_both_kernel_families_in_one_process(attention_checks):
    """auto, sm80 and sm80-small-smem each match the float64 reference in one process; on compute capability 9.0
    deterministic=True (sm_90a backward only) succeeds on auto and is refused under sm80, which shows the choice
    reaches the dispatcher."""
    if not jax_flash.cuda_available():
        pytest.skip("needs a CUDA GPU and jax_flash's CUDA kernels")
    case = attention_checks.Case(batch=2, seqlen_q=300, seqlen_k=257, heads_q=4, heads_kv=2, head_dim=128,
                                 is_causal=True)
    with jax.default_device(jax.devices("gpu")[0]):
        for kernel in ("auto", "sm80", "sm80-small-smem"):
            with jax_flash.force_kernel(kernel):
                attention_checks.check_against_reference(case, jnp.bfloat16, seed=3)
        if getattr(jax.devices("gpu")[0], "compute_capability", "") == "9.0":
            q, k, v, do = attention_checks.make_inputs(case, jnp.bfloat16)
            with jax_flash.force_kernel("auto"):
                attention_checks.fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, deterministic=True,
                                         **case.kwargs())
            with jax_flash.force_kernel("sm80"), pytest.raises(Exception, match="deterministic=True needs"):
                attention_checks.fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, deterministic=True,
                                         **case.kwargs())


def test_sm80_shared_memory_sizes_decide_where_the_kernels_fit():
    """The sm_80-class kernels' shared memory per block (cuda/kernels/sm80/launch_sm80.cuh): at head dim 256 the
    forward's 128 KB exceeds sm_86 / sm_89's 99 KB and the backward's 201 KB (per-warp; the CTA-wide one 209 KB)
    exceeds sm_80's 163 KB, while head dims up to 128 fit every sm_8x device."""
    if _ffi._jax_flash_cuda is None:
        pytest.skip("needs jax_flash's CUDA extension (built where nvcc is)")
    sizes = _ffi._jax_flash_cuda.sm80_smem_bytes
    sm80, sm86, sm90 = 163 * 1024, 99 * 1024, 227 * 1024
    assert sizes(256, False, sm86) == 128 * 1024 and sizes(256, False, sm80) == 128 * 1024
    assert sizes(256, True, sm80) == 205824  # the per-warp kernel, 201 KB: more than sm_80 has
    assert sizes(256, True, sm90) == 214016  # the CTA-wide one, 209 KB: sm_90 holds it
    for head_dim in (64, 128):
        for backward in (False, True):
            for device in (sm80, sm86):
                assert sizes(head_dim, backward, device) <= device, (head_dim, backward, device)
    assert sizes(128, True, sm80) > sizes(128, True, sm86)  # sm_80 runs the CTA-wide backward, sm_86 the per-warp


def test_calls_whose_kernel_does_not_fit_drop_the_cuda_branch(monkeypatch, fresh_warnings):
    """Where a kernel does not fit the GPU's shared memory (AttentionFitsDevice), the call's CUDA branch runs the
    XLA path instead, with one warning naming the direction and head dim."""
    import types

    from jax_flash import attention

    fits = {(256, False): False, (256, True): False}
    monkeypatch.setattr(_ffi, "attention_fits_device", lambda head_dim, backward: fits.get((head_dim, backward), True))
    cfg = types.SimpleNamespace(kernel_platforms=("cpu", "cuda"), deterministic=False)
    kernel = object()
    assert attention._fitting_platforms(cfg, kernel, 128, backward=True) == {"cpu": kernel, "cuda": kernel}
    with pytest.warns(RuntimeWarning, match="backward kernel at head dim 256 needs more shared memory"):
        assert attention._fitting_platforms(cfg, kernel, 256, backward=True) == {"cpu": kernel}
    with pytest.warns(RuntimeWarning, match="forward kernel at head dim 256 needs more shared memory"):
        assert attention._fitting_platforms(cfg, kernel, 256, backward=False) == {"cpu": kernel}
    assert attention._fitting_platforms(types.SimpleNamespace(kernel_platforms=("cpu",), deterministic=False),
                                        kernel, 256, backward=False) == {"cpu": kernel}
    # deterministic=True keeps its error: the XLA path's sums have no fixed order either
    with pytest.raises(ValueError, match="deterministic=True needs the sm_90a backward"):
        attention._fitting_platforms(types.SimpleNamespace(kernel_platforms=("cpu", "cuda"), deterministic=True),
                                     kernel, 256, backward=True)


def test_each_direction_asks_for_its_own_fit(monkeypatch, fresh_warnings):
    """As on an sm_80 GPU (163 KB): the head-dim-256 forward fits, the backward does not. Tracing a gradient asks
    the forward's fit and the backward's, and warns about the backward alone."""
    if "cuda" not in jax_flash.attention._kernel_platforms(jnp.bfloat16):
        pytest.skip("needs jax_flash's CUDA targets registered (a CUDA build)")
    asked = []

    def fits(head_dim, backward):
        asked.append((head_dim, backward))
        return not (head_dim > 128 and backward)

    monkeypatch.setattr(_ffi, "attention_fits_device", fits)
    q = jnp.ones((1, 40, 2, 256), jnp.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.make_jaxpr(jax.grad(lambda q: jax_flash.dot_product_attention(q, q, q, is_causal=True).astype(
            jnp.float32).sum()))(q)
    assert (256, False) in asked and (256, True) in asked, asked
    messages = [str(w.message) for w in caught if "shared memory" in str(w.message)]
    assert len(messages) == 1 and "the backward kernel at head dim 256" in messages[0], messages


@pytest.mark.gpu
def test_head_dim_256_on_a_99_kb_device_runs_the_xla_path(attention_checks, fresh_warnings):
    """Under "sm80-small-smem" (kernels picked and fitted as on a 99 KB sm_86 / sm_89 device) a head-dim-256 call
    warns and runs the XLA path, forward and backward, matching the float64 reference; head dim 128 keeps the
    kernels there; on an H100 / H200 every head dim fits."""
    if not jax_flash.cuda_available():
        pytest.skip("needs a CUDA GPU and jax_flash's CUDA kernels")
    if getattr(jax.devices("gpu")[0], "compute_capability", "") == "9.0":  # an H100 / H200: 227 KB a block
        with jax_flash.force_kernel("auto"):  # (JAX_FLASH_FORCE_SM80 may pick another family for the process)
            assert all(_ffi.attention_fits_device(d, b) for d in (64, 128, 256) for b in (False, True))
    case = attention_checks.Case(batch=1, seqlen_q=130, seqlen_k=97, heads_q=4, heads_kv=2, head_dim=256,
                                 is_causal=True)
    with jax.default_device(jax.devices("gpu")[0]), jax_flash.force_kernel("sm80-small-smem"):
        assert not _ffi.attention_fits_device(256, False) and not _ffi.attention_fits_device(256, True)
        assert _ffi.attention_fits_device(128, False) and _ffi.attention_fits_device(128, True)
        with pytest.warns(RuntimeWarning, match="needs more shared memory per block than this GPU has"):
            attention_checks.check_against_reference(case, jnp.bfloat16, seed=5)
        q = jnp.ones((1, 8, 2, 128), jnp.bfloat16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.block_until_ready(jax.grad(lambda q: jax_flash.dot_product_attention(q, q, q).astype(
                jnp.float32).sum())(q))
        assert not [w for w in caught if "shared memory" in str(w.message)]
