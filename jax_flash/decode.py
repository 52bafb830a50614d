"""``decode_attention``: a few new query rows against a long key/value cache (dense or paged), and ``combine``.

Semantics: query t of a call (t < Tq) sits at position ``kv_lengths[b] - Tq + t`` of its sequence, so the causal
mask is bottom-right aligned (``dot_product_attention``'s is top-left: there query t sits at position t), and a
local window is measured from that position. Keys at or past ``kv_lengths[b]`` are never read. Forward only.

On CUDA the call runs the decode kernels (``cuda/kernels/decode``): the query heads sharing a kv head, times Tq,
packed into the rows of one tile, the key range split across thread blocks (split-KV) and merged by a combine
kernel, paged caches read through the page table; on more than one device a paged cache is first gathered into a
dense one per sequence (page pools are not partitioned), which the decode kernels then read. On the CPU, and for a
query sharded over its rows, it runs jax_flash's attention kernel with the rows' global positions as offsets (up to
2^30 keys a sequence: caches past that run on the CUDA decode kernels only, whose windows of 2^30 or more count as
unbounded).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jax_flash import _ffi
from jax_flash import attention as _attention

__all__ = ["decode_attention", "combine", "MAX_QUERY_ROWS"]

#: The most query rows a decode call takes (speculative decoding, chunked prefill tails); more: use
#: ``dot_product_attention``.
MAX_QUERY_ROWS = _ffi.MAX_DECODE_QUERY_ROWS


def _check_num_splits(num_splits):
    if num_splits is None:
        return None
    if (isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral)
            or not 1 <= num_splits <= _ffi.MAX_DECODE_SPLITS):
        raise ValueError(f"num_splits must be None or an int in [1, {_ffi.MAX_DECODE_SPLITS}], got {num_splits!r}")
    return int(num_splits)


def _validate(q, k_cache, v_cache, kv_lengths, page_table):
    """Shapes, dtypes and (where concrete) values; returns (kv_lengths [batch], page_table, capacity)."""
    if q.ndim != 4:
        raise ValueError(f"query must have shape (batch, query_rows, heads, head_dim), got {q.shape}")
    batch, rows, heads_q, head_dim = q.shape
    if not 1 <= rows <= MAX_QUERY_ROWS:
        raise ValueError(f"decode_attention takes 1 to {MAX_QUERY_ROWS} query rows (dim 1 of query), got {rows}; "
                         "use jax_flash.dot_product_attention for longer queries")
    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"key_cache and value_cache must have one 4-d shape, got {k_cache.shape} and "
                         f"{v_cache.shape}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"query, key_cache and value_cache must share a dtype, got {q.dtype}, {k_cache.dtype} and "
                        f"{v_cache.dtype}")
    heads_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"the caches' head_dim {k_cache.shape[3]} differs from the query's {head_dim}")
    if heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of the caches' key/value heads ({heads_kv})")
    if page_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"a dense cache has shape (batch, seq, kv_heads, head_dim) with batch {batch}, got "
                             f"{k_cache.shape} (pass page_table for a paged cache)")
        capacity = k_cache.shape[1]
    else:
        dtype = _attention._dtype_of(page_table)  # before jnp narrows a 64-bit array
        page_table = jnp.asarray(page_table)
        if dtype != jnp.int32 or page_table.ndim != 2 or page_table.shape[0] != batch:
            raise ValueError(f"page_table must be int32 of shape (batch, max_pages) = ({batch}, ...), got shape "
                             f"{page_table.shape} and dtype {dtype}")
        if k_cache.shape[0] < 1 or k_cache.shape[1] < 1:
            raise ValueError(f"a paged cache (num_pages, page_size, kv_heads, head_dim) needs at least one page of at "
                             f"least one key, got shape {k_cache.shape}")
        capacity = page_table.shape[1] * k_cache.shape[1]
        if k_cache.shape[0] * k_cache.shape[1] > np.iinfo(np.int32).max:  # the kernels' int32 pool rows
            raise ValueError(f"a paged cache holds at most 2**31 - 1 keys (num_pages x page_size), got shape "
                             f"{k_cache.shape}")
    dtype = _attention._dtype_of(kv_lengths)
    kv_lengths = jnp.asarray(kv_lengths)
    if dtype != jnp.int32 or kv_lengths.shape not in ((batch,), ()):
        raise ValueError(f"kv_lengths must be int32 of shape (batch,) = ({batch},), or () for one length of every "
                         f"sequence, got shape {kv_lengths.shape} and dtype {dtype}")
    kv_lengths = jnp.broadcast_to(kv_lengths, (batch,))
    lengths = _attention._concrete(kv_lengths)
    if lengths is not None and ((lengths < 0).any() or (lengths > capacity).any()):
        raise ValueError(f"kv_lengths must lie in [0, {capacity}] (the cache's capacity), got {lengths.tolist()}")
    # The pages a sequence uses follow from its length: where the lengths are traced, unused entries (often -1
    # padding) cannot be told from used ones, and the kernels clamp page ids, so only concrete pairs are checked.
    if page_table is not None and lengths is not None:
        table = _attention._concrete(page_table)
        if table is not None:
            num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
            for b in range(batch):
                used = table[b, :math.ceil(lengths[b] / page_size)]
                if ((used < 0) | (used >= num_pages)).any():
                    raise ValueError(f"page_table[{b}] holds page ids outside [0, {num_pages}) among the pages its "
                                     f"kv_length uses: {used.tolist()}")
    return kv_lengths, page_table, capacity


def _gather_pages(cache, page_table):
    """A paged cache (num_pages, page_size, H, D) as the dense (B, max_pages * page_size, H, D) of each sequence;
    page ids clamped into range (whatever the values, nothing outside the cache is read)."""
    pages = jnp.clip(page_table, 0, cache.shape[0] - 1)
    gathered = _attention.sharding.gather_pages(cache, pages)  # (B, max_pages, page_size, H, D)
    return gathered.reshape(gathered.shape[0], -1, *cache.shape[2:])


def _local_decode(cfg, num_splits, uniform, q, k_cache, v_cache, lengths, page_table, sinks):
    """(o, lse [..., Hq, Tq]) of one device's block: the decode kernels on CUDA, elsewhere the attention kernel (or
    jax.nn's xla path) with the rows at the end of each sequence. ``uniform``: every sequence equally long (the
    split plan's hint). Leading dims beyond the batch (a vmapped axis kept by jax_flash.sharding; dense caches only)
    are folded into it."""
    lead = q.shape[:-3]
    if len(lead) != 1:
        fold = lambda x, n: None if x is None else x.reshape(-1, *x.shape[x.ndim - n:])  # noqa: E731
        # the folded batch's lengths may differ between its vmapped lanes: no uniform plan
        out, lse = _local_decode(cfg, num_splits, False, fold(q, 3), fold(k_cache, 3), fold(v_cache, 3),
                                 fold(lengths, 0), None, fold(sinks, 1))
        return out.reshape(q.shape), lse.reshape(*lead, *lse.shape[1:])
    rows = q.shape[1]

    def kernel(q, k_cache, v_cache, lengths, page_table, sinks):
        capacity = k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])
        splits, balance = ((num_splits, False) if num_splits
                           else _ffi.decode_split_plan(q.shape, k_cache.shape[2], capacity, page_table is not None,
                                                       uniform=uniform))
        return _ffi.flash_decode(q, k_cache, v_cache, lengths, page_table, sinks, num_splits=splits,
                                 balance_splits=balance, equal_lengths=uniform, **cfg.attrs())

    def other(q, k_cache, v_cache, lengths, page_table, sinks):
        k, v = ((_gather_pages(c, page_table) for c in (k_cache, v_cache)) if page_table is not None
                else (k_cache, v_cache))
        lengths = jnp.clip(lengths, 0, k.shape[1])  # the decode kernels clamp their own (no XLA kernel per call)
        return _attention._local_forward(cfg, q, k, v, lengths, lengths, None, None, sinks, q_offsets=lengths - rows)

    if "cuda" not in cfg.kernel_platforms:
        return other(q, k_cache, v_cache, lengths, page_table, sinks)
    if q.shape[2] // k_cache.shape[2] * rows > _ffi.MAX_DECODE_ROWS:
        _attention._warn_once("decode:rows", f"jax_flash.decode_attention: the decode kernel packs at most "
                              f"{_ffi.MAX_DECODE_ROWS} query rows per kv head (query heads per kv head x Tq = "
                              f"{q.shape[2] // k_cache.shape[2] * rows}); running the attention kernel instead",
                              stacklevel=3)
        return other(q, k_cache, v_cache, lengths, page_table, sinks)
    if not _ffi.decode_fits_device(q.shape[3], q.shape[2] // k_cache.shape[2] * rows):
        _attention._warn_once("decode:smem", f"jax_flash.decode_attention: the decode kernel at head dim {q.shape[3]} "
                              "needs more shared memory per block than this GPU has (above head dim 64, more than "
                              "the 99 KB of sm_86 / sm_89 GPUs); running the attention kernel instead", stacklevel=3)
        return other(q, k_cache, v_cache, lengths, page_table, sinks)
    return jax.lax.platform_dependent(q, k_cache, v_cache, lengths, page_table, sinks, default=other, cuda=kernel)


@functools.cache
def _sharded_block(num_splits, uniform, rows):
    """jax_flash.sharding's one-device function for a decode call over dense caches: the decode kernels on blocks
    that hold every query row (batch or head shards), the attention kernel with offsets on sequence shards."""

    def block(cfg, q, k, v, q_lens, kv_lens, q_seg=None, kv_seg=None, sinks=None, q_offsets=None):
        if q.shape[-3] == rows:
            return _local_decode(cfg, num_splits, uniform, q, k, v, kv_lens, None, sinks)
        return _attention._local_forward(cfg, q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks, q_offsets)

    return block


@jax.custom_jvp
def _forward_only(x):
    return x


@_forward_only.defjvp
def _forward_only_jvp(primals, tangents):
    raise TypeError("jax_flash.decode_attention is forward-only (inference): it has no gradient; use "
                    "jax_flash.dot_product_attention to train")


def decode_attention(query: ArrayLike, key_cache: ArrayLike, value_cache: ArrayLike, kv_lengths: ArrayLike, *,
                     page_table: ArrayLike | None = None, scale: float | None = None, is_causal: bool = True,
                     local_window_size: int | tuple[int, int] | None = None, num_splits: int | None = None,
                     return_residual: bool = False, logits_soft_cap: float | None = None,
                     sinks: ArrayLike | None = None):
    """Attention of the newest ``Tq`` query rows of each sequence against its key/value cache.

    Args:
      query: (B, Tq, Hq, D), 1 <= Tq <= 16 (bfloat16 or float16; float32 on the CPU).
      key_cache, value_cache: dense (B, S, Hkv, D), or paged (num_pages, page_size, Hkv, D) with ``page_table``;
        Hq a multiple of Hkv (GQA, MQA).
      kv_lengths: int32 (B,): the valid keys of each sequence, this step's included (at most the capacity: S, or
        max_pages * page_size); or int32 () when every sequence is equally long (a batch of prompts of one
        length): on a dense cache of up to 64 packed rows (query heads per kv head x Tq) the kernels then split
        the keys for equal lengths (fewer splits: one kernel, no combine, where the batch fills the GPU), which
        the lengths' values, on the device, cannot tell them; otherwise as the lengths broadcast to (B,).
      page_table: int32 (B, max_pages): page j of sequence b is ``key_cache[page_table[b, j]]``.
      scale: logit scale (default 1 / sqrt(D)).
      is_causal: query t sees keys up to its position ``kv_lengths[b] - Tq + t`` (bottom-right aligned).
      local_window_size: int or (left, right): keys within [position - left, position + right].
      num_splits: how many parts the key sequence is split into across thread blocks (None: chosen from the shape
        and the device; results agree within rounding whatever it is).
      return_residual: also return the log-sum-exp (B, Tq, Hq) float32 (-inf for a row that sees no key), for
        ``combine``.
      logits_soft_cap, sinks: as ``jax_flash.dot_product_attention``.

    Returns:
      (B, Tq, Hq, D) like query, or (output, lse) with ``return_residual``.

    Raises:
      ValueError / TypeError for bad shapes or dtypes, and for lengths or page ids out of range where their values
      are known (concrete); traced values are clamped so that nothing outside the caches is read. TypeError under
      differentiation (decode is forward-only).
    """
    q, k_cache, v_cache = (jnp.asarray(x) for x in (query, key_cache, value_cache))
    uniform = jnp.ndim(kv_lengths) == 0
    kv_lengths, page_table, capacity = _validate(q, k_cache, v_cache, kv_lengths, page_table)
    num_splits = _check_num_splits(num_splits)
    for name, flag in (("is_causal", is_causal), ("return_residual", return_residual)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    scale = _attention._check_scale(scale)
    window = _attention._check_window(local_window_size)
    sinks = _attention._check_sinks(sinks, q.shape[2])
    soft_cap = _attention._check_soft_cap(logits_soft_cap)
    if q.dtype not in _attention._KERNEL_DTYPES:
        raise TypeError(f"query and the caches must be bfloat16, float16 or float32, got {q.dtype}")
    head_dim = q.shape[-1]
    if head_dim == 0 or head_dim > _attention.MAX_HEAD_DIM or head_dim % _attention.HEAD_DIM_MULTIPLE:
        raise ValueError(f"head_dim must be a positive multiple of {_attention.HEAD_DIM_MULTIPLE} up to "
                         f"{_attention.MAX_HEAD_DIM}, got {head_dim}")
    q, k_cache, v_cache = _forward_only((q, k_cache, v_cache))

    rows = q.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q, scale = _attention._kernel_scale(q, scale)
    _attention._check_soft_cap_scale(soft_cap, scale)
    kernel_window = None
    if window is not None:
        window = tuple(min(w, capacity + rows) for w in window)
        # Row t sits at kv_length - Tq + t: a right side of Tq - 1 or more reaches every key it has (unbounded for
        # the kernels, whose position + right + 1 could pass int32 on a cache near 2^31 keys).
        kernel_window = (window[0], -1 if window[1] >= rows - 1 else window[1])
    cfg = _attention._Config(scale=scale, is_causal=bool(is_causal), window=window, kernel_window=kernel_window,
                             kernel_platforms=_attention._kernel_platforms(q.dtype), softcap=soft_cap,
                             has_sinks=sinks is not None)
    if sinks is not None:
        sinks = _forward_only(sinks)  # (a gradient through the sinks alone would reach the FFI call)
    sinks_bn = None if sinks is None else jnp.broadcast_to(sinks.astype(jnp.float32), (q.shape[0], q.shape[2]))
    if _attention.sharding._path(q, k_cache, v_cache)[0] == "local":
        out, lse = _local_decode(cfg, num_splits, uniform, q, k_cache, v_cache, kv_lengths, page_table, sinks_bn)
    else:  # partitioned as dot_product_attention: by batch and heads (sequence shards of Tq: offsets)
        if page_table is not None:
            if "cuda" in cfg.kernel_platforms:
                _attention._warn_once("decode:paged-sharded", "jax_flash.decode_attention: on more than one device "
                                      "a paged cache is gathered into a dense one per sequence before the decode "
                                      "kernel (page pools are not partitioned)", stacklevel=2)
            k_cache, v_cache = (_gather_pages(c, page_table) for c in (k_cache, v_cache))
        # Rows are valid up to the sequence's end: q_lens (global) = kv_lengths; row 0 sits at kv_lengths - Tq.
        lengths = jnp.clip(kv_lengths, 0, capacity)
        out, lse = _attention.sharding.forward(cfg, _sharded_block(num_splits, uniform, rows), q, k_cache, v_cache,
                                               lengths, lengths, None, None, sinks_bn, lengths - rows)
    if not return_residual:
        return out
    dead = -jnp.inf if sinks is None else sinks.astype(jnp.float32)[:, None]
    lse = jnp.where(lse == jnp.inf, dead, lse)  # rows that see no key: log of the sink's mass alone, or -inf
    return out, jnp.swapaxes(lse, -1, -2)


def combine(outputs: ArrayLike, lses: ArrayLike, axis: int = 0):
    """Merges partial attention results over parts of the keys (for example ``decode_attention`` over the pages of
    two caches, or over shards of one): ``outputs`` (..., B, Tq, Hq, D) and ``lses`` (..., B, Tq, Hq) stacked along
    ``axis``; returns (output, lse) as one call over all the keys would give them. Parts whose rows see no key
    (lse -inf) weigh nothing; a row that no part lets see a key gives 0 and -inf.

    Raises TypeError for arrays that are not floating-point, ValueError for shapes that do not agree or an ``axis``
    outside lses' dims."""
    outputs, lses = jnp.asarray(outputs), jnp.asarray(lses)
    if not (jnp.issubdtype(outputs.dtype, jnp.floating) and jnp.issubdtype(lses.dtype, jnp.floating)):
        raise TypeError(f"outputs and lses must be floating-point, got {outputs.dtype} and {lses.dtype}")
    if lses.ndim < 1 or outputs.shape[:-1] != lses.shape:
        raise ValueError(f"outputs {outputs.shape} and lses {lses.shape} must agree but for the outputs' last dim, "
                         "with the parts stacked along an axis")
    if (isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral)
            or not -lses.ndim <= axis < lses.ndim):
        raise ValueError(f"axis must be an int in [{-lses.ndim}, {lses.ndim}) (an axis of lses, shape {lses.shape}), "
                         f"got {axis!r}")
    axis = int(axis) % lses.ndim
    lses = lses.astype(jnp.float32)
    total = jax.nn.logsumexp(lses, axis=axis, keepdims=True)
    safe = jnp.where(jnp.isfinite(total), total, 0.0)
    weights = jnp.where(jnp.isneginf(lses), 0.0, jnp.exp(lses - safe))
    out = jnp.sum(outputs.astype(jnp.float32) * weights[..., None], axis=axis)
    return out.astype(outputs.dtype), jnp.squeeze(total, axis)
