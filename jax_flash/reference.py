"""A plain-JAX attention with jax_flash's semantics, materialising the full softmax. For testing only."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike


def visible_mask(seqlen_q: int, seqlen_k: int, *, is_causal: bool = False,
                 local_window_size: tuple[int, int] | None = None, query_seq_lengths: ArrayLike | None = None,
                 key_value_seq_lengths: ArrayLike | None = None, q_segment_ids: ArrayLike | None = None,
                 kv_segment_ids: ArrayLike | None = None, q_offsets: ArrayLike | None = None) -> jax.Array:
    """Boolean [B or 1, 1, Sq, Sk]: True where query row i may attend to key j.

    Key j is visible to row i when j <= i (if causal), i - left <= j <= i + right (for a window (left, right)),
    i < query_seq_lengths[b], j < key_value_seq_lengths[b] and q_segment_ids[b, i] == kv_segment_ids[b, j].
    ``q_offsets`` (int [B]) places row 0 of batch b at global position q_offsets[b] (a part of the rows); the
    positions, lengths and windows are global, the segment ids are those of the rows given.
    """
    i = jnp.arange(seqlen_q)[:, None]
    if q_offsets is not None:
        i = jnp.asarray(q_offsets)[:, None, None, None] + i  # [B, 1, Sq, 1]
    j = jnp.arange(seqlen_k)[None, :]
    mask = jnp.ones((seqlen_q, seqlen_k), bool)
    if is_causal:
        mask &= j <= i
    if local_window_size is not None:
        left, right = local_window_size
        mask &= (j >= i - left) & (j <= i + right)
    mask = mask if mask.ndim == 4 else mask[None, None]
    if query_seq_lengths is not None:
        mask = mask & (i < jnp.asarray(query_seq_lengths)[:, None, None, None])
    if key_value_seq_lengths is not None:
        mask = mask & (j < jnp.asarray(key_value_seq_lengths)[:, None, None, None])
    if q_segment_ids is not None:
        mask = mask & (jnp.asarray(q_segment_ids)[:, None, :, None] == jnp.asarray(kv_segment_ids)[:, None, None, :])
    return mask


def reference_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, *, scale: float | None = None,
                        is_causal: bool = False, query_seq_lengths: ArrayLike | None = None,
                        key_value_seq_lengths: ArrayLike | None = None,
                        local_window_size: int | tuple[int, int] | None = None,
                        q_segment_ids: ArrayLike | None = None, kv_segment_ids: ArrayLike | None = None,
                        sinks: ArrayLike | None = None, logits_soft_cap: float | None = None) -> jax.Array:
    """Attention computed with a materialised softmax in the promoted dtype of query, key and value.

    Takes the arguments of :func:`jax_flash.dot_product_attention` (layout BTNH or TNH, grouped-query attention,
    causal mask, local window as an int or (left, right), int [B] query and key/value lengths, segment ids, sinks,
    logit soft-cap) and follows its semantics: a query row that sees no key (rows >= its query length, a
    key/value length of 0, a window excluding every key, no key of its segment) outputs 0, and gets zero
    gradients. Callers choose the precision by upcasting the inputs (for example to float64 under
    ``jax.enable_x64``); no matmul is done at reduced precision.

    Returns:
      An array with the shape of ``query`` and the promoted dtype.
    """
    return attention_with_lse(query, key, value, scale=scale, is_causal=is_causal,
                              query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                              local_window_size=local_window_size, q_segment_ids=q_segment_ids,
                              kv_segment_ids=kv_segment_ids, sinks=sinks, logits_soft_cap=logits_soft_cap)[0]


def attention_with_lse(query, key, value, *, scale=None, is_causal=False, query_seq_lengths=None,
                       key_value_seq_lengths=None, local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
                       sinks=None, logits_soft_cap=None, q_offsets=None):
    """reference_attention's (output, lse): lse [B, N, T] (or [N, T]) in the promoted dtype is the log-sum-exp of
    the visible logits and the sinks; -inf for a row that sees no key and has no sink. ``q_offsets`` as in
    ``visible_mask`` (query at global positions, for a part of the rows); kv_segment_ids defaults to
    q_segment_ids."""
    dtype = jnp.result_type(query, key, value)
    q, k, v = (jnp.asarray(x, dtype) for x in (query, key, value))
    rank3 = q.ndim == 3
    if rank3:
        q, k, v = q[None], k[None], v[None]
        q_segment_ids = None if q_segment_ids is None else jnp.asarray(q_segment_ids)[None]
        kv_segment_ids = None if kv_segment_ids is None else jnp.asarray(kv_segment_ids)[None]
    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    _, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    group = heads_q // heads_kv
    k = jnp.repeat(k, group, axis=2)  # query head h reads key/value head h // group
    v = jnp.repeat(v, group, axis=2)

    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) * jnp.asarray(scale, dtype)
    if logits_soft_cap is not None:
        cap = jnp.asarray(logits_soft_cap, dtype)
        logits = cap * jnp.tanh(logits / cap)
    mask = visible_mask(seqlen_q, seqlen_k, is_causal=is_causal, local_window_size=local_window_size,
                        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_offsets=q_offsets)
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sink = jnp.asarray(sinks, dtype)[None, :, None, None]  # [1, N, 1, 1]
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0))
    weights = jnp.exp(logits - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    probs = weights / jnp.where(denom > 0, denom, 1)
    out = jnp.einsum("bnts,bsnh->btnh", probs, v, precision=hi)
    lse = (jnp.log(jnp.where(denom > 0, denom, 1)) + row_max)[..., 0]
    lse = jnp.where(denom[..., 0] > 0, lse, -jnp.inf)
    return (out[0], lse[0]) if rank3 else (out, lse)


def numpy_attention_fwd_bwd(query, key, value, dout, visible, *, scale=None, sinks=None, logits_soft_cap=None):
    """(out, dq, dk, dv) in float64 numpy, from a materialised softmax and its hand-written gradient; with
    ``sinks`` (float [N]) also their gradient: (out, dq, dk, dv, dsinks).

    query, dout: [B, T, N, H]; key, value: [B, S, K, H] (N a multiple of K); visible: bool, broadcastable to
    [B, N, T, S] (for example ``visible_mask(...)``). Semantics as jax_flash: rows that see no key output 0 and pass
    no gradient; a sink s_h adds exp(s_h) to each row's softmax denominator (no value); a soft cap c replaces each
    logit x by c * tanh(x / c) before masking. Masked pairs enter the sums with weight 0, so this is for finite
    inputs.
    """
    q, k, v, do = (np.asarray(x, np.float64) for x in (query, key, value, dout))
    visible = np.asarray(visible, bool)
    heads_q, heads_kv, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    group = heads_q // heads_kv
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)

    def einsum(spec, a, b):
        return np.einsum(spec, a, b, optimize=True)

    raw = scale * einsum("btnh,bsnh->bnts", q, k_rep)
    if logits_soft_cap is not None:
        tanh = np.tanh(raw / logits_soft_cap)
        raw = logits_soft_cap * tanh
    logits = np.where(visible, raw, -np.inf)
    row_max = logits.max(-1, keepdims=True)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
    if sink is not None:
        row_max = np.maximum(row_max, sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0)
    weights = np.exp(logits - row_max)
    denom = weights.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - row_max))
    probs = weights / np.where(denom > 0, denom, 1)
    out = einsum("bnts,bsnh->btnh", probs, v_rep)
    dprobs = einsum("btnh,bsnh->bnts", do, v_rep)
    delta = np.swapaxes((do * out).sum(-1), 1, 2)[..., None]  # [B, N, T, 1]: rowsum(dO * O)
    dlogits = probs * (dprobs - delta)
    if logits_soft_cap is not None:
        dlogits = dlogits * (1 - tanh**2)
    dq = scale * einsum("bnts,bsnh->btnh", dlogits, k_rep)

    def sum_groups(x):  # [B, S, N, H] -> [B, S, K, H]
        return x.reshape(*x.shape[:2], heads_kv, group, x.shape[-1]).sum(3)

    dk = sum_groups(scale * einsum("bnts,btnh->bsnh", dlogits, q))
    dv = sum_groups(einsum("bnts,btnh->bsnh", probs, do))
    if sink is None:
        return [out, dq, dk, dv]
    p_sink = np.exp(sink - row_max) / np.where(denom > 0, denom, 1)  # [B, N, T, 1]
    dsinks = -(p_sink * delta).sum(axis=(0, 2, 3))
    return [out, dq, dk, dv, dsinks]
