"""``dot_product_attention``: jax.nn.dot_product_attention's interface on top of the fused jax_flash kernels."""

import dataclasses
import functools
import math
import numbers
import operator
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jax_flash import _ffi, sharding

#: The ``implementation`` argument: None for the jax_flash kernels, else jax.nn's implementation of that name.
Implementation = Literal["xla", "cudnn"] | None

MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
#: Longest query or key sequence of the kernels (their masks take differences of int32 positions; kMaxSeqLen in
#: cuda/ffi/validation.h).
MAX_SEQ_LEN = 2**30
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_CUDA_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ACCELERATOR_PLATFORMS = ("cuda", "rocm", "tpu")

# Reasons already warned about (each fallback reason is reported once per process).
_WARNED: set[str] = set()


def _warn_once(reason, message, stacklevel):
    """Warns `message` unless `reason` was already warned about; `stacklevel` counts from the caller."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static (hashable) parameters of one kernel call."""

    scale: float
    is_causal: bool
    window: tuple[int, int] | None  # (left, right), already clamped; None = unbounded
    kernel_platforms: tuple[str, ...]  # platforms that run the kernel; every other one runs jax.nn's xla path
    deterministic: bool = False  # bitwise-reproducible backward
    # The kernels' window: -1 for a side no (row, key) pair of the call reaches, so that calls take the unmasked
    # paths and kernel variants (None: as `window`). Only for calls without position offsets.
    kernel_window: tuple[int, int] | None = None
    softcap: float | None = None  # logit soft cap
    has_sinks: bool = False  # o and lse include sinks (the xla fallback's backward then works from them)
    # The forward may run the decode kernels on CUDA (few query rows, every row valid, no position-dependent mask:
    # jax.nn-style decode calls), set by dot_product_attention.
    decode: bool = False
    # ... and every sequence has all Sk keys (no key_value_seq_lengths): the decode split plan for equal lengths.
    decode_uniform: bool = False

    def attrs(self):
        window = self.kernel_window if self.kernel_window is not None else self.window
        left, right = window if window is not None else (-1, -1)
        return dict(scale=self.scale, is_causal=self.is_causal, window_left=left, window_right=right,
                    softcap=self.softcap)


def _xla_attention(cfg, q, k, v, q_lens, kv_lens, q_offsets=None):
    """jax.nn's xla implementation: (output, lse float32 [B, N, T]) for the platforms without a kernel.

    ``q_offsets`` (int32 [B], or None for 0): the global position of q's row 0 when q holds a part of the rows
    (sequence sharding). The masks go to jax.nn as a dense mask at global positions, and a row that sees no key
    outputs 0 with lse +inf, as the kernels do (jax.nn would give it the mean of the values). Leading dims beyond the
    batch (a vmapped axis kept by jax_flash.sharding) are folded into it."""
    lead = q.shape[:-3]
    if len(lead) != 1:
        fold = lambda x, n: None if x is None else x.reshape(-1, *x.shape[len(x.shape) - n:])  # noqa: E731
        out, lse = _xla_attention(cfg, fold(q, 3), fold(k, 3), fold(v, 3), fold(q_lens, 0), fold(kv_lens, 0),
                                  fold(q_offsets, 0))
        return out.reshape(q.shape), lse.reshape(*lead, *lse.shape[1:])
    if q_offsets is None:  # (jax.nn's own lengths would give a row that sees no key the values' mean)
        q_offsets = jnp.zeros((q.shape[0],), jnp.int32)
    rows = q_offsets[:, None] + jnp.arange(q.shape[-3], dtype=jnp.int32)  # [B, T] global positions
    i, j = rows[:, :, None], jnp.arange(k.shape[-3], dtype=jnp.int32)[None, None, :]
    visible = (i < q_lens[:, None, None]) & (j < kv_lens[:, None, None])
    if cfg.is_causal:
        visible &= j <= i
    if cfg.window is not None:
        visible &= (i - cfg.window[0] <= j) & (j <= i + cfg.window[1])
    out, residual = jax.nn.dot_product_attention(
        q, k, v, mask=visible[:, None], scale=cfg.scale, implementation="xla", return_residual=True)
    sees = jnp.any(visible, axis=-1)[:, :, None, None]  # [B, T, 1, 1]
    out = jnp.where(sees, out, jnp.zeros((), out.dtype))
    lse = jnp.swapaxes(jnp.where(sees[..., 0], residual, jnp.inf), -1, -2).astype(jnp.float32)
    return out, lse


def _dense_logits(cfg, q, k, q_lens, kv_lens, q_seg, kv_seg, q_offsets):
    """Float32 logits [..., N, T, S] (soft-capped, -inf where masked) and the visibility mask, materialised: the
    xla fallback of calls with segment ids, sinks or a soft cap. Leading dims: any (q_lens [...])."""
    from jax_flash import reference

    group = q.shape[-2] // k.shape[-2]
    kr = jnp.repeat(k.astype(jnp.float32), group, axis=-2)
    raw = jnp.einsum("...tnh,...snh->...nts", q.astype(jnp.float32), kr, precision=jax.lax.Precision.HIGHEST)
    raw = raw * cfg.scale
    if cfg.softcap is not None:
        raw = cfg.softcap * jnp.tanh(raw / cfg.softcap)
    lead = q.shape[:-3]
    flat = lambda x: None if x is None else x.reshape(-1, *x.shape[len(lead):])  # noqa: E731
    visible = reference.visible_mask(
        q.shape[-3], k.shape[-3], is_causal=cfg.is_causal, local_window_size=cfg.window,
        query_seq_lengths=flat(q_lens), key_value_seq_lengths=flat(kv_lens), q_segment_ids=flat(q_seg),
        kv_segment_ids=flat(kv_seg), q_offsets=flat(q_offsets))
    visible = jnp.broadcast_to(visible, (max(visible.shape[0], math.prod(lead)), *visible.shape[1:]))
    visible = visible.reshape(*lead, *visible.shape[1:])
    return jnp.where(visible, raw, -jnp.inf), visible


def _dense_forward(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks, q_offsets=None):
    """(o, lse) as the kernel gives them, from a materialised float32 softmax (sinks [..., N] or None)."""
    logits, visible = _dense_logits(cfg, q, k, q_lens, kv_lens, q_seg, kv_seg, q_offsets)
    sees = jnp.any(visible, axis=-1)  # [..., 1, T]
    row_max = jnp.max(logits, axis=-1)
    if sinks is not None:
        row_max = jnp.maximum(row_max, sinks.astype(jnp.float32)[..., None])
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(logits - row_max[..., None])  # 0 where masked
    denom = jnp.sum(weights, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32)[..., None] - row_max)
    lse = jnp.where(sees, jnp.log(denom) + row_max, jnp.inf)
    probs = jnp.where(sees[..., None], weights / denom[..., None], 0.0)
    group = q.shape[-2] // k.shape[-2]
    vr = jnp.repeat(v.astype(jnp.float32), group, axis=-2)
    o = jnp.einsum("...nts,...snh->...tnh", probs, vr, precision=jax.lax.Precision.HIGHEST)
    return o.astype(q.dtype), lse


def _dense_backward(cfg, q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg, q_offsets=None):
    """(dq, dk, dv) from o and lse as the kernels compute them (P = exp(logit - lse), dS = P (dP - rowsum(dO O)),
    through the soft cap's 1 - tanh^2), materialised in float32."""
    logits, visible = _dense_logits(cfg, q, k, q_lens, kv_lens, q_seg, kv_seg, q_offsets)
    probs = jnp.where(visible, jnp.exp(logits - jnp.where(lse == jnp.inf, 0.0, lse)[..., None]), 0.0)
    group = q.shape[-2] // k.shape[-2]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    hi = jax.lax.Precision.HIGHEST
    kr, vr = jnp.repeat(f32(k), group, axis=-2), jnp.repeat(f32(v), group, axis=-2)
    dprobs = jnp.einsum("...tnh,...snh->...nts", f32(do), vr, precision=hi)
    delta = jnp.swapaxes(jnp.sum(f32(do) * f32(o), axis=-1), -1, -2)[..., None]
    ds = jnp.where(visible, probs * (dprobs - delta), 0.0)
    if cfg.softcap is not None:
        ds = ds * (1 - jnp.square(jnp.where(visible, logits, 0.0) / cfg.softcap))
    ds = ds * cfg.scale
    fold = lambda x: x.reshape(*x.shape[:-2], k.shape[-2], group, x.shape[-1]).sum(-2)  # noqa: E731
    dq = jnp.einsum("...nts,...snh->...tnh", ds, kr, precision=hi)
    dk = fold(jnp.einsum("...nts,...tnh->...snh", ds, f32(q), precision=hi))
    dv = fold(jnp.einsum("...nts,...tnh->...snh", probs, f32(do), precision=hi))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _has_options(cfg, q_seg):
    """Whether the call uses an option jax.nn lacks (its xla fallback is then a materialised softmax)."""
    return q_seg is not None or cfg.has_sinks or cfg.softcap is not None


def _fitting_platforms(cfg, kernel, head_dim, backward):
    """{platform: kernel} for the call's kernel platforms, less CUDA where the kernel does not fit the GPU's shared
    memory per block (the sm_80-class kernels at head dim 256 on sm_80 / sm_86 / sm_89): warns once, and the call
    runs its XLA path there."""
    platforms = list(cfg.kernel_platforms)
    if "cuda" in platforms and not _ffi.attention_fits_device(head_dim, backward):
        if backward and cfg.deterministic:  # (the XLA path's sums have no fixed order either)
            raise ValueError("deterministic=True needs the sm_90a backward kernel for head_dim <= 128: compute "
                             f"capability 9.0 (this GPU's backward kernel at head dim {head_dim} does not fit its "
                             "shared memory)")
        platforms.remove("cuda")
        direction = "backward" if backward else "forward"
        _warn_once(f"smem:{direction}:{head_dim}", f"jax_flash.dot_product_attention: the {direction} kernel at head "
                   f"dim {head_dim} needs more shared memory per block than this GPU has (the sm_80-class kernels "
                   "at head dim 256: the forward 128 KB, the backward 201 KB); on cuda it runs "
                   "jax.nn.dot_product_attention(implementation='xla') (or a materialised softmax) instead",
                   stacklevel=3)
    return {platform: kernel for platform in platforms}


def _local_forward(cfg, q, k, v, q_lens, kv_lens, q_seg=None, kv_seg=None, sinks=None, q_offsets=None):
    """(o, lse) of one device's block: the kernel on its platforms, elsewhere jax.nn's xla path (or a materialised
    softmax, for the options jax.nn lacks)."""

    def kernel(q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks, q_offsets):
        return _ffi.flash_fwd(q, k, v, q_lens, kv_lens, q_offsets, None, q_seg, kv_seg, sinks, **cfg.attrs())

    def fallback(q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks, q_offsets):
        if _has_options(cfg, q_seg):
            return _dense_forward(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks, q_offsets)
        return _xla_attention(cfg, q, k, v, q_lens, kv_lens, q_offsets)

    def decode_kernel(q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks, q_offsets):
        splits, balance = _ffi.decode_split_plan(q.shape, k.shape[2], k.shape[1], uniform=cfg.decode_uniform)
        return _ffi.flash_decode(q, k, v, kv_lens, None, sinks, num_splits=splits, balance_splits=balance,
                                 equal_lengths=cfg.decode_uniform, **cfg.attrs())

    branches = _fitting_platforms(cfg, kernel, q.shape[-1], backward=False)
    packed_rows = q.shape[2] // k.shape[2] * q.shape[1] if q.ndim == 4 else 0
    # (a GPU whose shared memory the decode kernel does not fit, sm_86 / sm_89 above head dim 64, keeps the kernel)
    if ("cuda" in branches and cfg.decode and q_offsets is None and q_seg is None and q.ndim == 4
            and packed_rows <= _ffi.MAX_DECODE_ROWS and _ffi.decode_fits_device(q.shape[3], packed_rows)):
        branches["cuda"] = decode_kernel
    return jax.lax.platform_dependent(q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks, q_offsets, default=fallback,
                                      **branches)


def _forward(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks):
    return sharding.forward(cfg, _local_forward, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks)


def _xla_attention_vjp(cfg, q, k, v, o, lse, do, q_lens, kv_lens, q_offsets=None):
    del o, lse
    _, vjp = jax.vjp(lambda q, k, v: _xla_attention(cfg, q, k, v, q_lens, kv_lens, q_offsets)[0], q, k, v)
    return vjp(do)


def _local_backward(cfg, q, k, v, o, lse, do, q_lens, kv_lens, q_seg=None, kv_seg=None, q_offsets=None):
    """(dq, dk, dv) of one device's block (dk, dv: the contributions of its query rows)."""

    def kernel(q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg, q_offsets):
        return _ffi.flash_bwd(q, k, v, o, lse, do, q_lens, kv_lens, q_offsets, None, q_seg, kv_seg, **cfg.attrs(),
                              deterministic=cfg.deterministic)

    def fallback(q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg, q_offsets):
        if _has_options(cfg, q_seg):
            return _dense_backward(cfg, q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg, q_offsets)
        return _xla_attention_vjp(cfg, q, k, v, o, lse, do, q_lens, kv_lens, q_offsets)

    return jax.lax.platform_dependent(q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg, q_offsets,
                                      default=fallback, **_fitting_platforms(cfg, kernel, q.shape[-1], backward=True))


def _backward(cfg, q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg):
    return sharding.backward(cfg, _local_backward, q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_attention(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks):
    """(o, lse) for q [B, T, N, H], k/v [B, S, K, H], int32 lengths [B], int32 segment ids [B, T] and [B, S] or
    None, float32 sinks [N] or None. With sinks, o and lse are the sink-inclusive ones."""
    return _flash_attention_fwd(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks)[0]


def _flash_attention_fwd(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks):
    # Sinks per (batch, head), so that they shard with q's heads.
    sinks_bn = None if sinks is None else jnp.broadcast_to(sinks.astype(jnp.float32), (*q.shape[:-3], q.shape[-2]))
    o, lse = _forward(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks_bn)
    return (o, lse), (q, k, v, o, lse, q_lens, kv_lens, q_seg, kv_seg, sinks)


def _flash_attention_bwd(cfg, residuals, cotangents):
    q, k, v, o, lse, q_lens, kv_lens, q_seg, kv_seg, sinks = residuals
    do, _ = cotangents  # lse only leaves through stop_gradient
    # With sinks, o and lse already hold them: the kernels' P = exp(logit - lse) and rowsum(dO * O) are those of
    # the softmax with sinks, so dq, dk, dv come out right.
    dq, dk, dv = _backward(cfg, q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg)
    dsinks = None
    if sinks is not None:
        # d o_i / d s_h = -p_sink(i) o_i, p_sink(i) = exp(s_h - lse_i): d sinks_h = -sum_i p_sink(i) dO_i . O_i.
        delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [..., T, N]
        p_sink = jnp.exp(sinks.astype(jnp.float32)[:, None] - lse)  # [..., N, T]; 0 where lse = +inf
        share = p_sink * jnp.swapaxes(delta, -1, -2)  # (sums, not a contraction: fine on Explicit meshes)
        dsinks = -jnp.sum(share, axis=(*range(share.ndim - 2), share.ndim - 1)).astype(sinks.dtype)
        dsinks = sharding.cotangent_like(dsinks, sinks)
    return dq, dk, dv, None, None, None, None, dsinks


_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)


@functools.cache
def _present_accelerators():
    """Accelerator platforms with a JAX backend in this process."""
    present = []
    for platform in _ACCELERATOR_PLATFORMS:
        try:
            jax.devices(platform)
        except RuntimeError:
            continue
        present.append(platform)
    return tuple(present)


def _kernel_platforms(dtype):
    """The platforms that run the kernel for `dtype`; warns once about present backends that will not."""
    platforms = ["cpu"]
    if dtype in _CUDA_KERNEL_DTYPES and _ffi.CUDA_REGISTERED:
        platforms.append("cuda")
    for platform in _present_accelerators():
        if platform in platforms:
            continue
        if platform != "cuda":
            why = f"jax_flash has no kernel for {platform}"
        elif not _ffi.CUDA_REGISTERED:
            why = _ffi.CUDA_UNAVAILABLE_REASON
        else:
            why = f"the CUDA kernels take bfloat16 or float16, got {dtype}"
        _warn_once(f"platform:{platform}:{why}",
                   f"jax_flash.dot_product_attention: {why}; on {platform} it runs "
                   "jax.nn.dot_product_attention(implementation='xla') instead.", stacklevel=3)
    return tuple(platforms)


def _check_lengths(lengths, name, batch):
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(f"{name} must be an int32 array of shape (batch,) = ({batch},), got shape "
                         f"{lengths.shape} and dtype {lengths.dtype}")
    return lengths


def _check_scale(scale):
    if scale is None:
        return None
    message = f"scale must be a static Python float, got {scale!r}"
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (numbers.Real, np.ndarray, jax.Array)):
        raise TypeError(message)
    try:
        scale = np.asarray(scale)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(message) from e
    if scale.ndim != 0 or scale.dtype.kind not in "fiu":
        raise TypeError(message)
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    if not np.isfinite(_kernel_scale_log2(abs(value))):
        raise ValueError(f"scale * log2(e) must fit a float32 (|scale| up to about 2.36e38), got {value}")
    return value


def _kernel_scale_log2(scale: float) -> np.float32:
    """scale * log2(e) as the kernels' handlers compute it, in float32."""
    with np.errstate(over="ignore"):
        return np.float32(scale) * np.float32(math.log2(math.e))


def _kernel_scale(q: jax.Array, scale: float) -> tuple[jax.Array, float]:
    """(q, scale) as the kernels take them: they assume scale * log2(e) a positive normal float32 (their fast math
    flushes a subnormal to 0, and a running max of -inf times 0 is NaN), so a negative scale's sign, and a scale too
    small for that (0 included), fold into q."""
    if scale < 0:
        q, scale = -q, -scale
    if not _kernel_scale_log2(scale) >= np.finfo(np.float32).tiny:
        q, scale = (q.astype(jnp.float32) * scale).astype(q.dtype), 1.0
    return q, scale


def _check_window(local_window_size):
    """None or (left, right) ints >= 0."""
    if local_window_size is None:
        return None
    sizes = local_window_size if isinstance(local_window_size, (tuple, list)) else (local_window_size,) * 2
    if len(sizes) != 2:
        raise TypeError(f"local_window_size must be an int or a (left, right) pair of ints, got {local_window_size!r}")
    window = []
    for size in sizes:
        if isinstance(size, (bool, np.bool_)):
            raise TypeError(f"local_window_size must hold ints, got {local_window_size!r}")
        try:
            size = operator.index(size)
        except TypeError as e:
            raise TypeError(f"local_window_size must be an int or a (left, right) pair of static ints, got "
                            f"{local_window_size!r}") from e
        if size < 0:
            raise ValueError(f"local_window_size must be >= 0, got {local_window_size!r}")
        window.append(size)
    return tuple(window)


def _dtype_of(x):
    """x's dtype as given, before jnp.asarray narrows 64-bit types (arrays, tracers, Python sequences)."""
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype if dtype is not None else np.asarray(x).dtype)


def _full_lengths(batch: int, seqlen: int) -> np.ndarray:
    """The lengths of a call given none: every row (key) valid. The kernels clamp lengths to [0, seqlen] and the
    fallbacks compare positions below them, so seqlen, seqlen + 1, ... mean the same as seqlen for each batch element,
    and a numpy constant of distinct values stays a constant in the program: XLA turns one of equal elements into a
    broadcast, a kernel before every call (as _ffi._placeholder's stand-ins)."""
    if seqlen + batch > np.iinfo(np.int32).max:
        return np.full((batch,), seqlen, np.int32)
    return np.arange(seqlen, seqlen + batch, dtype=np.int32)


def _check_segment_ids(q_segment_ids, kv_segment_ids, query, key):
    """(q ids, kv ids) as int32 arrays [B, T], [B, S] ([T], [S] for rank-3 inputs), or (None, None)."""
    if q_segment_ids is None:
        if kv_segment_ids is not None:
            raise ValueError("kv_segment_ids needs q_segment_ids (a query's segment decides which keys it sees)")
        return None, None
    lead = query.shape[:-2]  # (B, T) or (T,)
    if kv_segment_ids is None:
        if query.shape[-3] != key.shape[-3]:
            raise ValueError(f"kv_segment_ids is required when the query and key/value lengths differ (got "
                             f"{query.shape[-3]} and {key.shape[-3]}); it defaults to q_segment_ids only when they "
                             "are equal")
        kv_segment_ids = q_segment_ids
    ids = []
    for name, x, shape in (("q_segment_ids", q_segment_ids, lead), ("kv_segment_ids", kv_segment_ids,
                                                                     key.shape[:-2])):
        dtype = _dtype_of(x)
        if dtype != np.int32:
            raise TypeError(f"{name} must be int32, got {dtype}")
        x = jnp.asarray(x)
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape} ((batch, length) of the "
                             f"{'query' if name[0] == 'q' else 'key/value'}; (length,) for rank-3 inputs), got "
                             f"{x.shape}")
        ids.append(x)
    return tuple(ids)


def _concrete(x):
    """x as a numpy array when its value is known now (not a tracer), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_sinks(sinks, num_heads):
    if sinks is None:
        return None
    dtype = _dtype_of(sinks)
    if dtype != np.float32:
        raise TypeError(f"sinks must be float32, got {dtype}")
    sinks = jnp.asarray(sinks)
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must have shape (num_query_heads,) = ({num_heads},), got {sinks.shape}")
    values = _concrete(sinks)  # known now (not traced): a sink's logit must be finite
    if values is not None and not np.isfinite(values).all():
        raise ValueError(f"sinks must be finite, got {values.tolist()}")
    if values is not None and (np.abs(values.astype(np.float64)) * math.log2(math.e) > np.finfo(np.float32).max).any():
        raise ValueError(f"sinks * log2(e) must fit a float32 (|sinks| up to about 2.36e38), got {values.tolist()}")
    return sinks


def _check_soft_cap(logits_soft_cap):
    if logits_soft_cap is None:
        return None
    message = f"logits_soft_cap must be None or a static Python float, got {logits_soft_cap!r}"
    if isinstance(logits_soft_cap, (bool, np.bool_)) or not isinstance(logits_soft_cap, (numbers.Real, np.ndarray,
                                                                                          jax.Array)):
        raise TypeError(message)
    try:
        value = np.asarray(logits_soft_cap)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(message) from e
    if value.ndim != 0 or value.dtype.kind not in "fiu":
        raise TypeError(message)
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"logits_soft_cap must be finite and > 0, got {value}")
    return value


def _check_soft_cap_scale(soft_cap, scale):
    """The kernels take a soft cap c as scale / c and c / scale in float32 (their fast math flushes a subnormal to
    0): c and both must be normal float32 numbers, as the handlers check. `scale`: the kernel's (_kernel_scale)."""
    if soft_cap is None:
        return
    tiny = np.finfo(np.float32).tiny
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        cap, kernel_scale = np.float32(soft_cap), np.float32(scale)
        parts = (cap, kernel_scale / cap, cap / kernel_scale)
    if not all(np.isfinite(x) and x >= tiny for x in parts):
        raise ValueError(f"logits_soft_cap must be a normal float32 with scale / logits_soft_cap and logits_soft_cap / "
                         f"scale normal float32 numbers too (float32 has about 1.2e-38 to 3.4e38), got "
                         f"logits_soft_cap={soft_cap} with scale {float(scale):g}")


def _validate(query, key, value, is_causal, query_seq_lengths, key_value_seq_lengths):
    """Checks what every implementation needs; returns the length arrays as arrays."""
    if query.ndim not in (3, 4):
        raise ValueError(f"query must have rank 4 (BTNH) or 3 (TNH), got shape {query.shape}")
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(f"{name} must have the rank of query ({query.ndim}), got shape {x.shape}")
        if x.dtype != query.dtype:
            raise ValueError(f"{name} dtype must match query dtype {query.dtype}, got {x.dtype}")
    if value.shape != key.shape:
        raise ValueError(f"value shape must equal key shape {key.shape}, got {value.shape}")
    if query.shape[:-3] != key.shape[:-3]:
        raise ValueError(f"key batch size must equal query's: query shape {query.shape}, key shape {key.shape}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key head_dim must equal query head_dim {query.shape[-1]}, got key shape {key.shape}")
    heads_q, heads_kv = query.shape[-2], key.shape[-2]
    if heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"the number of query heads must be a multiple of the key/value heads, got "
                         f"{heads_q} query heads and {heads_kv} key/value heads")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    batch = query.shape[0] if query.ndim == 4 else 1
    return (_check_lengths(query_seq_lengths, "query_seq_lengths", batch),
            _check_lengths(key_value_seq_lengths, "key_value_seq_lengths", batch))


def dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Implementation = None,
    return_residual: bool = False,
    deterministic: bool = False,
    q_segment_ids: ArrayLike | None = None,
    kv_segment_ids: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Scaled dot-product attention; a drop-in for :func:`jax.nn.dot_product_attention` run by a fused kernel.

    Computes ``softmax(scale * Q K^T + mask) V`` per head without materialising the attention matrix, on CPU and
    CUDA GPUs, forward and backward (through :func:`jax.custom_vjp`; jit, grad, vmap and checkpoint compose; forward
    mode and second order do not: ``implementation="xla"`` has them).

    Shapes (as jax.nn): B batch, T query length, S key/value length, N query heads, K key/value heads (N a
    multiple of K: grouped-query or, with K = 1, multi-query attention), H head dim.

    Args:
      query: (B, T, N, H) or (T, N, H).
      key: (B, S, K, H) or (S, K, H), the dtype of query.
      value: the shape and dtype of key.
      bias: optional additive bias broadcastable to (B, N, T, S). The kernel takes no dense bias: the call runs
        jax.nn's xla implementation instead and warns once.
      mask: optional boolean mask broadcastable to (B, N, T, S), True = attend. As for ``bias``, runs jax.nn's
        xla implementation and warns once.
      scale: static logit scale; default ``1 / sqrt(H)``.
      is_causal: key j is visible to query i only if j <= i (top-left aligned, as jax.nn).
      query_seq_lengths: optional int32 (B,): rows at or past the length output 0.
      key_value_seq_lengths: optional int32 (B,): keys at or past the length are masked.
      local_window_size: optional int w, meaning (w, w), or (left, right): key j is visible to query i only if
        i - left <= j <= i + right.
      implementation: None (default) runs the jax_flash kernels; ``"xla"`` or ``"cudnn"`` call
        jax.nn.dot_product_attention with that implementation.
      return_residual: also return the log-sum-exp of the masked, scaled logits, shape (B, T, N) or (T, N), in
        the input dtype, under stop_gradient; -inf for rows that see no key (with ``sinks``: the sink-inclusive
        log-sum-exp, the sink's logit for such rows).
      deterministic: (jax_flash only) make the kernel backward bitwise reproducible: key blocks add their dQ
        contributions in a fixed order instead of as they finish. The CPU kernel always is. On CUDA it needs the
        sm_90a backward (compute capability 9.0, H <= 128); elsewhere the backward fails with an error saying so.
        The forward is deterministic either way. Costs some backward speed (key blocks wait for their turn).
        Ignored with ``implementation="xla"`` or ``"cudnn"`` and on jax.nn fallback paths.
      q_segment_ids: optional int32 (B, T) (or (T,)): packed sequences; query i sees key j only if their ids are
        equal (and every other mask allows it). MaxText's ``decoder_segment_ids`` pass through unchanged.
      kv_segment_ids: optional int32 (B, S) (or (S,)); defaults to ``q_segment_ids`` when T == S.
      sinks: optional float32 (N,), differentiable: attention sinks, a per-head logit with no value in the softmax
        denominator: ``p_ij = exp(x_ij) / (exp(sinks[h]) + sum_j exp(x_ij))``. The residual is then the
        sink-inclusive log-sum-exp; the gradient with respect to the sinks is returned.
      logits_soft_cap: optional static float c > 0: logits become ``c * tanh(scale * q.k / c)`` before masking
        (Gemma 2).

    Segment ids, sinks and soft-capping run in the kernels, forward and backward. Where no jax_flash kernel runs
    (another accelerator, or float32 on a GPU), calls with them take a materialised float32 softmax in plain JAX
    (O(T * S) memory), since jax.nn has none of them.

    Returns:
      The attention output with the shape and dtype of ``query``, or ``(output, residual)`` if
      ``return_residual``.

    Sharding: under ``jax.jit`` with sharded inputs the call partitions instead of gathering (jax_flash.sharding):
    batch and head dims of q (with k/v's heads alongside) stay sharded with no collective and the output keeps
    q's sharding; with q's sequence sharded, K and V are all-gathered and each device runs its rows at their
    global positions. ``Auto`` mesh axes go through custom_partitioning, ``Explicit`` ones through shard_map.
    Query heads sharded over an axis whose size does not divide the key/value heads raise ValueError (except one
    key/value head, which is replicated).

    Supported by the kernels: bfloat16 and float16 everywhere, float32 on CPU; H a multiple of 8 up to 256. With
    float32 inputs on a GPU (or on any platform without a kernel) the call runs jax.nn's xla implementation there,
    and warns once when such a backend is present.

    Semantics differ from jax.nn's xla implementation in one case: a query row below its query length that sees
    no key (key/value length 0, or a window or causal mask excluding every key) outputs 0 and passes zero
    gradients, where jax.nn averages every value uniformly. Rows at or past ``query_seq_lengths`` are 0 in both.

    Non-finite inputs: nan and inf in query, key or value propagate as through jax.nn's xla implementation (a nan
    or +inf logit makes its row nan, a -inf logit weighs 0, a row whose visible logits are all -inf is nan, a
    non-finite value reaches the rows that see it, and gradients follow); rows that see no key still output 0.
    jax.nn also carries them through the zero weight of masked positions (0 * nan) into other rows' gradients. The
    CUDA kernels do too (their tensor-core products include such pairs with zero weights); the CPU kernel does that
    at most within one of its tiles, never from keys that no row sees nor from rows that see no key.

    Raises:
      ValueError: inconsistent shapes or dtypes between query, key and value; a head dim the kernels do not take;
        length arrays that are not int32 (B,); segment ids or sinks of the wrong shape, sinks whose values are
        known and not finite; a bias or mask that does not broadcast to (B, N, T, S); a negative window,
        non-finite scale or a soft cap that is not finite and > 0 (or, with the scale, leaves scale / cap or
        cap / scale outside float32's normal numbers); sequences longer than 2^30; an unknown implementation;
        segment ids, sinks or a soft cap with ``implementation="xla"``/``"cudnn"`` or with ``bias``/``mask``;
        ``deterministic=True`` where the sm_90a backward does not run (only on compute capability 9.0, head dims up
        to 128; elsewhere on a GPU the handler raises it when the call runs).
      TypeError: an unsupported dtype (with a bias or mask: one that is not floating-point); segment ids that are
        not int32 or sinks that are not float32; a non-bool ``is_causal``, ``deterministic`` or
        ``return_residual``; a window, scale or soft cap that is not a static number.
    """
    for name, flag in (("deterministic", deterministic), ("return_residual", return_residual)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    extras = [name for name, x in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids),
                                   ("sinks", sinks), ("logits_soft_cap", logits_soft_cap)) if x is not None]
    if extras and (implementation is not None or bias is not None or mask is not None):
        why = f"implementation={implementation!r}" if implementation is not None else "a dense bias or mask"
        raise ValueError(f"{', '.join(extras)}: jax_flash options that jax.nn.dot_product_attention does not take; "
                         f"they cannot be combined with {why}")
    if implementation in ("xla", "cudnn"):
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
            implementation=implementation, return_residual=return_residual)
    if implementation is not None:
        raise ValueError(f"implementation must be None, 'xla' or 'cudnn', got {implementation!r}")

    q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    q_lens, kv_lens = _validate(q, k, v, is_causal, query_seq_lengths, key_value_seq_lengths)
    scale = _check_scale(scale)
    window = _check_window(local_window_size)
    q_seg, kv_seg = _check_segment_ids(q_segment_ids, kv_segment_ids, q, k)
    sinks = _check_sinks(sinks, q.shape[-2])
    soft_cap = _check_soft_cap(logits_soft_cap)

    for name, array in (("bias", bias), ("mask", mask)):
        if array is not None:
            # jax.nn's shapes: (B, N, T, S), B = 1 for rank-3 inputs, or fewer dims and dims of 1 that broadcast
            target = (q.shape[0] if q.ndim == 4 else 1, q.shape[-2], q.shape[-3], k.shape[-3])
            shape = jnp.shape(array)
            if len(shape) > len(target) or any(d not in (1, t) for d, t in zip(shape[::-1], target[::-1])):
                raise ValueError(f"{name} must broadcast to (batch, heads, query rows, keys) = {target}, got shape "
                                 f"{shape}")
            if not jnp.issubdtype(q.dtype, jnp.floating):
                raise TypeError(f"query, key and value must be floating-point, got {q.dtype}")
            _warn_once(name, f"jax_flash.dot_product_attention: the kernels take no dense {name}; running "
                             "jax.nn.dot_product_attention(implementation='xla') instead", stacklevel=2)
            return jax.nn.dot_product_attention(
                q, k, v, bias, mask, scale=scale, is_causal=bool(is_causal), query_seq_lengths=q_lens,
                key_value_seq_lengths=kv_lens, local_window_size=window, implementation="xla",
                return_residual=return_residual)

    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"query, key and value must be bfloat16, float16 or float32, got {q.dtype}")
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM or head_dim % HEAD_DIM_MULTIPLE or head_dim == 0:
        raise ValueError(f"head_dim (the last dim of query, key and value) must be a positive multiple of "
                         f"{HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}, got {head_dim}")

    rank3 = q.ndim == 3
    if rank3:
        q, k, v = q[None], k[None], v[None]
        q_seg, kv_seg = (None if x is None else x[None] for x in (q_seg, kv_seg))
    batch, seqlen_q, _, _ = q.shape
    seqlen_k = k.shape[1]

    if q.size == 0 or k.size == 0:  # nothing to attend to (or nothing asks): every row outputs 0
        out = jnp.zeros_like(q)
        empty = -jnp.inf if sinks is None else sinks.astype(q.dtype)  # the sink alone
        lse = jnp.broadcast_to(jnp.asarray(empty, q.dtype), q.shape[:-1])
    else:
        q_lens = _full_lengths(batch, seqlen_q) if q_lens is None else jnp.clip(q_lens, 0, seqlen_q)
        kv_lens = _full_lengths(batch, seqlen_k) if kv_lens is None else jnp.clip(kv_lens, 0, seqlen_k)
        kernel_window = None
        if window is not None:
            window = tuple(min(w, seqlen_q + seqlen_k) for w in window)
            # Key j >= i - left holds for every row i < seqlen_q once left >= seqlen_q - 1, and j <= i + right for
            # every key j < seqlen_k once right >= seqlen_k - 1.
            kernel_window = (-1 if window[0] >= seqlen_q - 1 else window[0],
                             -1 if window[1] >= seqlen_k - 1 else window[1])
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        if max(seqlen_q, seqlen_k) > MAX_SEQ_LEN:
            raise ValueError(f"the kernels take sequences of up to 2^30 rows and keys, got {seqlen_q} query rows and "
                             f"{seqlen_k} keys")
        q, scale = _kernel_scale(q, scale)
        _check_soft_cap_scale(soft_cap, scale)
        # jax.nn-style decode (a few rows, all valid, against a long cache, no position-dependent mask) runs the
        # split-KV decode kernels forward on CUDA.
        decode = (seqlen_q <= _ffi.MAX_DECODE_QUERY_ROWS and query_seq_lengths is None and not is_causal and
                  (kernel_window is None or kernel_window == (-1, -1)) and q_seg is None)
        cfg = _Config(scale=scale, is_causal=bool(is_causal), window=window,
                      kernel_platforms=_kernel_platforms(q.dtype), deterministic=bool(deterministic),
                      kernel_window=kernel_window, softcap=soft_cap, has_sinks=sinks is not None, decode=decode,
                      decode_uniform=decode and key_value_seq_lengths is None)
        out, lse = _flash_attention(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks)
        if return_residual:
            # The kernels store +inf for rows that see no key (and have no sink); the log of their mass is -inf.
            dead = -jnp.inf if sinks is None else sinks[:, None]  # a row that sees no key: the sink's mass alone
            lse = jnp.where(lse == jnp.inf, dead, lse)
            lse = jnp.swapaxes(lse, -1, -2).astype(q.dtype)

    if rank3:
        out, lse = out[0], lse[0]
    if return_residual:
        return out, jax.lax.stop_gradient(lse)
    return out
