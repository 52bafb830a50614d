"""Context-parallel ring attention: the sequence axis sharded over a mesh axis, K/V passed around the ring.

``ring_attention`` runs inside ``jax.shard_map`` (or under ``ring_attention_sharded``, which builds the shard_map).
Each shard keeps its queries; the K/V blocks travel around the ring with ``lax.ppermute`` (the next block's transfer
is issued before the kernel on the current one, so XLA can overlap them); every step calls the flash kernel on the
local queries against the visiting block with global position offsets, and the partial outputs merge through their
log-sum-exps (O and lse accumulated in float32). The backward runs the ring again: each step's kernel takes the
whole attention's O and lse and gives the local share of dQ and the visiting block's dK/dV, which travel with their
block (accumulated in float32) and come home after the last step.

Layouts: ``"contiguous"``: shard r holds positions [r*S/n, (r+1)*S/n). ``"zigzag"``: the sequence is cut into 2n
equal chunks and shard r holds chunks r and 2n-1-r, in that order, which balances causal work over the shards;
``zigzag_order`` / ``zigzag_restore`` put a sequence into that order and back. For zigzag, each (query chunk, key
chunk) pair is a batch element of one kernel call with its own offsets.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_flash import _ffi, sharding
from jax_flash.attention import (_check_scale, _check_segment_ids, _check_sinks, _check_soft_cap,
                                 _check_soft_cap_scale, _check_window, _kernel_scale, _validate, MAX_SEQ_LEN)

__all__ = ["ring_attention", "ring_attention_sharded", "zigzag_order", "zigzag_restore"]

LAYOUTS = ("contiguous", "zigzag")
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------------------------------------------------------
# Zigzag order


def _zigzag_chunks(n):
    """Global chunk indices in zigzag order: shard r holds chunks r and 2n-1-r."""
    return [c for r in range(n) for c in (r, 2 * n - 1 - r)]


def _check_zigzag(x, n, axis):
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n (the ring size) must be a positive int, got {n!r}")
    axis = axis % x.ndim
    if x.shape[axis] % (2 * n):
        raise ValueError(f"zigzag layout: the sequence length {x.shape[axis]} (axis {axis}) must be divisible by "
                         f"2 * n = {2 * n} (2n equal chunks for a ring of {n} shards)")
    return int(n), axis


def zigzag_order(x, n, axis=1):
    """Puts a sequence in zigzag order for a ring of ``n`` shards: cut the axis into 2n equal chunks and order them
    0, 2n-1, 1, 2n-2, ..., so that sharding the result evenly over n devices gives shard r chunks r and 2n-1-r.

    Args:
      x: array; axis: the sequence axis (1 for [B, S, H, D]). The length must be divisible by 2n.
    """
    x = jnp.asarray(x)
    n, axis = _check_zigzag(x, n, axis)
    chunks = jnp.split(x, 2 * n, axis=axis)
    return jnp.concatenate([chunks[c] for c in _zigzag_chunks(n)], axis=axis)


def zigzag_restore(x, n, axis=1):
    """The inverse of ``zigzag_order``: back to sequence order."""
    x = jnp.asarray(x)
    n, axis = _check_zigzag(x, n, axis)
    chunks = jnp.split(x, 2 * n, axis=axis)
    inverse = np.argsort(_zigzag_chunks(n))
    return jnp.concatenate([chunks[i] for i in inverse], axis=axis)


# ----------------------------------------------------------------------------------------------------------------
# The ring


@dataclasses.dataclass(frozen=True)
class _RingConfig:
    axis_name: object
    ring_size: int
    chunks: int  # per shard: 1 (contiguous) or 2 (zigzag)
    scale: float
    is_causal: bool
    window: tuple[int, int] | None
    softcap: float | None = None

    def attrs(self):
        left, right = self.window if self.window is not None else (-1, -1)
        return dict(scale=self.scale, is_causal=self.is_causal, window_left=left, window_right=right,
                    softcap=self.softcap)


def _axis_size(axis_name):
    if hasattr(jax.lax, "axis_size"):
        return int(jax.lax.axis_size(axis_name))
    return int(jax.lax.psum(1, axis_name))


def _chunk_index(cfg, shard, i):
    """Global index (in units of the chunk length) of local chunk i of `shard` (int32 scalar)."""
    if cfg.chunks == 1:
        return shard
    return shard if i == 0 else 2 * cfg.ring_size - 1 - shard


def _offsets(cfg, shard, chunk_len, batch, kv):
    """int32 [m(q chunk), m(kv chunk), B]: the offsets of the folded pairs, for the q side (kv=False) or kv side."""
    m = cfg.chunks
    rows = []
    for qi in range(m):
        row = []
        for kj in range(m):
            idx = _chunk_index(cfg, shard, kj if kv else qi)
            row.append(jnp.broadcast_to((idx * chunk_len).astype(jnp.int32), (batch,)))
        rows.append(jnp.stack(row))
    return jnp.stack(rows)


def _fold_q(x, m):
    """[B, m*c, ...] -> [m, m, B, c, ...] (query chunk qi at [qi, kj] for every kj)."""
    b, s = x.shape[:2]
    x = jnp.moveaxis(x.reshape(b, m, s // m, *x.shape[2:]), 1, 0)
    return jnp.broadcast_to(x[:, None], (m, m, *x.shape[1:]))


def _fold_kv(x, m):
    """[B, m*c, ...] -> [m, m, B, c, ...] (key chunk kj at [qi, kj] for every qi)."""
    b, s = x.shape[:2]
    x = jnp.moveaxis(x.reshape(b, m, s // m, *x.shape[2:]), 1, 0)
    return jnp.broadcast_to(x[None], (m, m, *x.shape[1:]))


def _fold_stats(x, m):
    """lse-like [B, H, m*c] -> [m, m, B, H, c] (query chunk qi at [qi, kj])."""
    b, h, s = x.shape
    x = jnp.moveaxis(x.reshape(b, h, m, s // m), 2, 0)
    return jnp.broadcast_to(x[:, None], (m, m, *x.shape[1:]))


def _flat(x):
    """[m, m, B, ...] -> [m*m*B, ...]."""
    return x.reshape(-1, *x.shape[3:])


def _unflat(x, m):
    return x.reshape(m, m, -1, *x.shape[1:])


def _unfold_rows(x):
    """[m, B, c, ...] -> [B, m*c, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _unfold_stats(x):
    """[m, B, H, c] -> [B, H, m*c]."""
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape(*x.shape[:2], -1)


def _ring_perm(n):
    return [(i, (i + 1) % n) for i in range(n)]


def _ring_forward(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks):
    """(o like q, lse float32 [B, Hq, S_local] with +inf for rows that see no key); with sinks (float32 [Hq]) both
    sink-inclusive. The key/value segment ids travel with K and V."""
    n, m = cfg.ring_size, cfg.chunks
    batch, s_local = q.shape[:2]
    c = s_local // m
    rank = jax.lax.axis_index(cfg.axis_name)
    perm = _ring_perm(n)
    q_f = _flat(_fold_q(q, m))
    lens = lambda x: _flat(jnp.broadcast_to(x, (m, m, batch)))
    q_lens_f, kv_lens_f = lens(q_lens), lens(kv_lens)
    q_off = _flat(_offsets(cfg, rank, c, batch, kv=False))
    q_seg_f = None if q_seg is None else _flat(_fold_q(q_seg, m))

    acc_o = jnp.zeros((m, batch, c, *q.shape[2:]), jnp.float32)
    acc_lse = jnp.full((m, batch, q.shape[2], c), -jnp.inf, jnp.float32)
    for step in range(n):
        # Issue the next block's transfer before the kernel on this one (each array on its own: one dtype a call).
        if step + 1 < n:
            k_next = jax.lax.ppermute(k, cfg.axis_name, perm)
            v_next = jax.lax.ppermute(v, cfg.axis_name, perm)
            kv_seg_next = None if kv_seg is None else jax.lax.ppermute(kv_seg, cfg.axis_name, perm)
        source = (rank - step) % n
        kv_off = _flat(_offsets(cfg, source, c, batch, kv=True))
        kv_seg_f = None if kv_seg is None else _flat(_fold_kv(kv_seg, m))
        o, lse = _ffi.flash_fwd(q_f, _flat(_fold_kv(k, m)), _flat(_fold_kv(v, m)), q_lens_f, kv_lens_f, q_off,
                                kv_off, q_seg_f, kv_seg_f, **cfg.attrs())
        o, lse = _unflat(o, m).astype(jnp.float32), _unflat(lse, m)  # [qi, kj, B, ...]
        lse = jnp.where(lse == jnp.inf, -jnp.inf, lse)
        new = jnp.logaddexp(acc_lse, jax.scipy.special.logsumexp(lse, axis=1))
        safe = jnp.where(jnp.isfinite(new), new, 0.0)  # exp(-inf - safe) = 0: no mass
        to_rows = lambda w: jnp.swapaxes(w, -1, -2)[..., None]  # [..., H, c] -> [..., c, H, 1]
        acc_o = (acc_o * to_rows(jnp.exp(acc_lse - safe))
                 + jnp.sum(o * to_rows(jnp.exp(lse - safe[:, None])), axis=1))
        acc_lse = new
        if step + 1 < n:
            k, v, kv_seg = k_next, v_next, kv_seg_next
    if sinks is not None:  # the sink joins each row's denominator; it has no value
        new = jnp.logaddexp(acc_lse, sinks.astype(jnp.float32)[:, None])
        acc_o = acc_o * jnp.swapaxes(jnp.exp(acc_lse - new), -1, -2)[..., None]  # 0 for rows that see no key
        acc_lse = jnp.where(acc_lse == -jnp.inf, -jnp.inf, new)  # those keep +inf below
    o = _unfold_rows(acc_o).astype(q.dtype)
    lse = _unfold_stats(jnp.where(acc_lse == -jnp.inf, jnp.inf, acc_lse))
    return o, lse


def _ring_backward(cfg, q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg):
    n, m = cfg.ring_size, cfg.chunks
    batch, s_local = q.shape[:2]
    c = s_local // m
    rank = jax.lax.axis_index(cfg.axis_name)
    perm = _ring_perm(n)
    # The backward sends K/V around again rather than keeping the forward's n received blocks alive until here:
    # the barrier keeps XLA from merging these transfers with the forward's identical ones (CSE) when both are in
    # one program.
    k, v, kv_seg = jax.lax.optimization_barrier((k, v, kv_seg))
    q_f, o_f, do_f = (_flat(_fold_q(x, m)) for x in (q, o, do))
    lse_f = _flat(_fold_stats(lse, m))
    lens = lambda x: _flat(jnp.broadcast_to(x, (m, m, batch)))
    q_lens_f, kv_lens_f = lens(q_lens), lens(kv_lens)
    q_off = _flat(_offsets(cfg, rank, c, batch, kv=False))
    q_seg_f = None if q_seg is None else _flat(_fold_q(q_seg, m))

    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)  # travels with its block
    dv = jnp.zeros(v.shape, jnp.float32)
    for step in range(n):
        if step + 1 < n:
            k_next = jax.lax.ppermute(k, cfg.axis_name, perm)
            v_next = jax.lax.ppermute(v, cfg.axis_name, perm)
            kv_seg_next = None if kv_seg is None else jax.lax.ppermute(kv_seg, cfg.axis_name, perm)
        source = (rank - step) % n
        kv_off = _flat(_offsets(cfg, source, c, batch, kv=True))
        kv_seg_f = None if kv_seg is None else _flat(_fold_kv(kv_seg, m))
        dq_f, dk_f, dv_f = _ffi.flash_bwd(q_f, _flat(_fold_kv(k, m)), _flat(_fold_kv(v, m)), o_f, lse_f, do_f,
                                          q_lens_f, kv_lens_f, q_off, kv_off, q_seg_f, kv_seg_f, **cfg.attrs())
        # dQ: sum over key chunks -> [qi, B, c, ...]; dK/dV: sum over query chunks -> [kj, B, c, ...].
        dq = dq + _unfold_rows(jnp.sum(_unflat(dq_f, m).astype(jnp.float32), axis=1))
        dk = dk + _unfold_rows(jnp.sum(_unflat(dk_f, m).astype(jnp.float32), axis=0))
        dv = dv + _unfold_rows(jnp.sum(_unflat(dv_f, m).astype(jnp.float32), axis=0))
        if step + 1 < n:
            # The dK/dV sends below wait for the next block's arrival: otherwise XLA's collective-permute combiner
            # may merge them with the next block's K/V transfer, which then cannot start before this kernel ends.
            dk, dv, k_next, v_next, kv_seg_next = jax.lax.optimization_barrier((dk, dv, k_next, v_next,
                                                                                kv_seg_next))
        # The block's gradients move on with it; after the last step this send brings them home.
        dk = jax.lax.ppermute(dk, cfg.axis_name, perm)
        dv = jax.lax.ppermute(dv, cfg.axis_name, perm)
        if step + 1 < n:
            k, v, kv_seg = k_next, v_next, kv_seg_next
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks):
    return _ring_forward(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks)[0]


def _ring_fwd(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks):
    o, lse = _ring_forward(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks)
    return o, (q, k, v, o, lse, q_lens, kv_lens, q_seg, kv_seg, sinks)


def _ring_bwd(cfg, residuals, do):
    q, k, v, o, lse, q_lens, kv_lens, q_seg, kv_seg, sinks = residuals
    # With sinks, o and lse hold them: the kernels' P = exp(logit - lse) and rowsum(dO * O) are right as they are.
    dq, dk, dv = _ring_backward(cfg, q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg)
    dsinks = None
    if sinks is not None:
        # This shard's rows' share of the gradient.
        delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, S_local, N]
        p_sink = jnp.exp(sinks.astype(jnp.float32)[:, None] - lse)  # [B, N, S_local]; 0 where lse = +inf
        dsinks = -jnp.einsum("bnt,btn->n", p_sink, delta).astype(sinks.dtype)
        # Under shard_map's type checks the sinks are invariant over axes the shares vary over: summed there.
        dsinks = sharding.cotangent_like(dsinks, sinks)
    return dq, dk, dv, None, None, None, None, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(query, key, value, *, axis_name, layout="contiguous", is_causal=False, scale=None,
                   local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None, q_segment_ids=None,
                   kv_segment_ids=None, sinks=None, logits_soft_cap=None):
    """Context-parallel (ring) flash attention; call inside ``jax.shard_map`` with the sequence sharded on
    ``axis_name``.

    Args:
      query: the local [B, S/n, Hq, D] (or [S/n, Hq, D]) part of the query; key, value: the local [B, S/n, Hkv, D]
        parts (GQA: Hq a multiple of Hkv; only the Hkv heads travel). One dtype (bfloat16, float16; float32 on CPU).
        Batch and heads may be sharded on other mesh axes (pass the local parts of the length arrays then).
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded over; its size n is the ring size.
      layout: ``"contiguous"`` (shard r holds positions [r*S/n, (r+1)*S/n)) or ``"zigzag"`` (the sequence cut into
        2n chunks, shard r holds chunks r and 2n-1-r in that order; see ``zigzag_order``).
      is_causal, scale, local_window_size: as ``jax_flash.dot_product_attention``, at global positions.
      query_seq_lengths, key_value_seq_lengths: optional int32 [B] global lengths (positions >= length are padding,
        in global sequence order, whatever the layout).
      q_segment_ids, kv_segment_ids: optional int32 [B, S/n] (or [S/n]): the local parts of the segment ids, in the
        layout's order like the arrays (kv_segment_ids defaults to q_segment_ids); the key/value ids travel around
        the ring with their block.
      sinks: optional float32 [Hq] (replicated over the ring axis; its gradient is the sum of the shards' shares).
      logits_soft_cap: optional static float c > 0. All three as ``jax_flash.dot_product_attention``.

    Returns:
      the local part of the output, like query.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    q_lens, kv_lens = _validate(q, k, v, is_causal, query_seq_lengths, key_value_seq_lengths)
    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"query, key and value must be bfloat16, float16 or float32, got {q.dtype}")
    scale = _check_scale(scale)
    window = _check_window(local_window_size)
    q_seg, kv_seg = _check_segment_ids(q_segment_ids, kv_segment_ids, q, k)
    sinks = _check_sinks(sinks, q.shape[-2])
    soft_cap = _check_soft_cap(logits_soft_cap)
    try:
        n = _axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"ring_attention must run inside jax.shard_map with the sequence sharded over "
                         f"axis_name={axis_name!r}: {e}") from e
    rank3 = q.ndim == 3
    if rank3:
        q, k, v = q[None], k[None], v[None]
        q_seg, kv_seg = (None if x is None else x[None] for x in (q_seg, kv_seg))
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"ring_attention: query and key/value must hold the same local sequence length, got "
                         f"{q.shape[1]} and {k.shape[1]}")
    s_local = q.shape[1]
    chunks = 2 if layout == "zigzag" else 1
    if s_local == 0 or s_local % chunks:
        raise ValueError(f"ring_attention (layout={layout!r}): the local sequence length {s_local} must be "
                         + ("even (the global length divisible by 2n, n the ring size)" if chunks == 2
                            else "positive"))
    s_global = s_local * n
    if s_global > MAX_SEQ_LEN:
        raise ValueError(f"the kernels take sequences of up to 2^30 positions, got {s_local} x {n} ring devices")
    batch = q.shape[0]
    q_lens = jnp.full((batch,), s_global, jnp.int32) if q_lens is None else jnp.clip(q_lens, 0, s_global)
    kv_lens = jnp.full((batch,), s_global, jnp.int32) if kv_lens is None else jnp.clip(kv_lens, 0, s_global)
    if window is not None:
        window = tuple(min(w, s_global) for w in window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, scale = _kernel_scale(q, scale)
    _check_soft_cap_scale(soft_cap, scale)
    cfg = _RingConfig(axis_name=axis_name, ring_size=n, chunks=chunks, scale=scale, is_causal=bool(is_causal),
                      window=window, softcap=soft_cap)
    out = _ring(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks)
    return out[0] if rank3 else out


# ----------------------------------------------------------------------------------------------------------------
# shard_map wrapper


def _shard_map(f, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        try:
            return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        except TypeError:
            return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
    from jax.experimental.shard_map import shard_map
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _axes_size(mesh, axes):
    if axes is None:
        return 1
    axes = axes if isinstance(axes, tuple) else (axes,)
    for a in axes:
        if a not in mesh.shape:
            raise ValueError(f"ring_attention_sharded: mesh axis {a!r} is not in the mesh's axes "
                             f"{tuple(mesh.shape)}")
    return math.prod(mesh.shape[a] for a in axes)


def ring_attention_sharded(query, key, value, *, mesh, seq_axis, batch_axis=None, head_axis=None,
                           layout="contiguous", query_seq_lengths=None, key_value_seq_lengths=None,
                           q_segment_ids=None, kv_segment_ids=None, sinks=None, **kwargs):
    """``ring_attention`` over whole (global) [B, S, H, D] arrays: builds the ``shard_map`` for you.

    The sequence is sharded over ``seq_axis`` (the ring), the batch over ``batch_axis`` and the heads (query and
    key/value heads together) over ``head_axis`` (each None, a mesh axis name or a tuple of names). The arrays are
    taken in the layout's order: for ``layout="zigzag"`` pass ``zigzag_order(x, n)`` (n the size of ``seq_axis``),
    and the output comes back in that order (``zigzag_restore`` undoes it). Lengths are global, int32 [B], in
    sequence order. Segment ids (int32 [B, S], in the arrays' order) are sharded like the sequence, sinks
    (float32 [Hq]) like the heads. Other keyword arguments (``is_causal``, ``scale``, ``local_window_size``,
    ``logits_soft_cap``) go to ``ring_attention``. Works under ``jit`` and ``grad``.
    """
    q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"ring_attention_sharded takes [B, S, H, D] arrays, got shapes {q.shape}, {k.shape}, "
                         f"{v.shape}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if seq_axis is None:
        raise ValueError("ring_attention_sharded needs seq_axis, the mesh axis of the ring")
    n = _axes_size(mesh, seq_axis)
    nb, nh = _axes_size(mesh, batch_axis), _axes_size(mesh, head_axis)
    chunks = 2 * n if layout == "zigzag" else n
    for name, x in (("query", q), ("key", k)):
        if x.shape[1] % chunks:
            raise ValueError(f"ring_attention_sharded (layout={layout!r}): the {name} sequence length {x.shape[1]} "
                             f"must be divisible by {chunks} (" + ("2n chunks, " if layout == "zigzag" else "")
                             + f"ring size n = {n} over {seq_axis!r})")
    if q.shape[0] % nb:
        raise ValueError(f"ring_attention_sharded: the batch {q.shape[0]} is not divisible by the size {nb} of "
                         f"batch_axis={batch_axis!r}")
    if q.shape[2] % nh or k.shape[2] % nh:
        raise ValueError(f"ring_attention_sharded: head_axis={head_axis!r} of size {nh} must divide both the query "
                         f"heads ({q.shape[2]}) and the key/value heads ({k.shape[2]})")
    spec = P(batch_axis, seq_axis, head_axis, None)
    lens_spec = P(batch_axis)
    batch = q.shape[0]
    lens = [jnp.full((batch,), q.shape[1], jnp.int32) if x is None else jnp.asarray(x)
            for x in (query_seq_lengths, key_value_seq_lengths)]
    for name, x in zip(("query_seq_lengths", "key_value_seq_lengths"), lens):
        if x.shape != (batch,) or x.dtype != jnp.int32:
            raise ValueError(f"{name} must be an int32 array of shape (batch,) = ({batch},), got shape {x.shape} "
                             f"and dtype {x.dtype}")

    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    options = {name: (jnp.asarray(x), s) for name, x, s in (
        ("q_segment_ids", q_segment_ids, P(batch_axis, seq_axis)),
        ("kv_segment_ids", kv_segment_ids, P(batch_axis, seq_axis)),
        ("sinks", sinks, P(head_axis))) if x is not None}
    for name in ("q_segment_ids", "kv_segment_ids"):
        if name in options and options[name][0].shape != (batch, q.shape[1]):
            raise ValueError(f"{name} must have shape (batch, seq) = ({batch}, {q.shape[1]}), got "
                             f"{options[name][0].shape}")
    names = tuple(options)

    def body(q, k, v, q_lens, kv_lens, *opts):
        return ring_attention(q, k, v, axis_name=seq_axis, layout=layout, query_seq_lengths=q_lens,
                              key_value_seq_lengths=kv_lens, **dict(zip(names, opts)), **kwargs)

    f = _shard_map(body, mesh, (spec, spec, spec, lens_spec, lens_spec, *(options[n][1] for n in names)), spec)
    q, k, v = (_place(x, mesh, spec) for x in (q, k, v))
    return f(q, k, v, *(_place(x, mesh, lens_spec) for x in lens),
             *(_place(options[n][0], mesh, options[n][1]) for n in names))


def _place(x, mesh, spec):
    """x laid out as `spec` on `mesh`, as shard_map's in_specs need it (a mesh with Explicit axes checks them)."""
    sharding = jax.sharding.NamedSharding(mesh, spec)
    if any(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ())):
        return jax.sharding.reshard(x, sharding)
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)
