"""A plain-JAX attention with jax_flash's semantics, materialising the full softmax. For testing only."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike


def visible_mask(seqlen_q: int, seqlen_k: int, *, is_causal: bool = False,
                 local_window_size: tuple[int, int] | None = None, query_seq_lengths: ArrayLike | None = None,
                 key_value_seq_lengths: ArrayLike | None = None) -> jax.Array:
    """Boolean [B or 1, 1, Sq, Sk]: True where query row i may attend to key j.

    Key j is visible to row i when j <= i (if causal), i - left <= j <= i + right (for a window (left, right)),
    i < query_seq_lengths[b] and j < key_value_seq_lengths[b].
    """
    i = jnp.arange(seqlen_q)[:, None]
    j = jnp.arange(seqlen_k)[None, :]
    mask = jnp.ones((seqlen_q, seqlen_k), bool)
    if is_causal:
        mask &= j <= i
    if local_window_size is not None:
        left, right = local_window_size
        mask &= (j >= i - left) & (j <= i + right)
    mask = mask[None, None]
    if query_seq_lengths is not None:
        mask = mask & (i < jnp.asarray(query_seq_lengths)[:, None, None, None])
    if key_value_seq_lengths is not None:
        mask = mask & (j < jnp.asarray(key_value_seq_lengths)[:, None, None, None])
    return mask


def reference_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, *, scale: float | None = None,
                        is_causal: bool = False, query_seq_lengths: ArrayLike | None = None,
                        key_value_seq_lengths: ArrayLike | None = None,
                        local_window_size: int | tuple[int, int] | None = None) -> jax.Array:
    """Attention computed with a materialised softmax in the promoted dtype of query, key and value.

    Takes the arguments of :func:`jax_flash.dot_product_attention` (layout BTNH or TNH, grouped-query attention,
    causal mask, local window as an int or (left, right), int [B] query and key/value lengths) and follows its
    semantics: a query row that sees no key (rows >= its query length, a key/value length of 0, or a window
    excluding every key) outputs 0, and gets zero gradients. Callers choose the precision by upcasting the inputs
    (for example to float64 under ``jax.enable_x64``); no matmul is done at reduced precision.

    Returns:
      An array with the shape of ``query`` and the promoted dtype.
    """
    dtype = jnp.result_type(query, key, value)
    q, k, v = (jnp.asarray(x, dtype) for x in (query, key, value))
    rank3 = q.ndim == 3
    if rank3:
        q, k, v = q[None], k[None], v[None]
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
    mask = visible_mask(seqlen_q, seqlen_k, is_causal=is_causal, local_window_size=local_window_size,
                        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths)
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    weights = jnp.exp(logits - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom > 0, denom, 1)
    out = jnp.einsum("bnts,bsnh->btnh", probs, v, precision=hi)
    return out[0] if rank3 else out


def numpy_attention_fwd_bwd(query, key, value, dout, visible, *, scale=None):
    """(out, dq, dk, dv) in float64 numpy, from a materialised softmax and its hand-written gradient.

    query, dout: [B, T, N, H]; key, value: [B, S, K, H] (N a multiple of K); visible: bool, broadcastable to
    [B, N, T, S] (for example ``visible_mask(...)``). Semantics as jax_flash: rows that see no key output 0 and pass
    no gradient. Masked pairs enter the sums with weight 0, so this is for finite inputs.
    """
    q, k, v, do = (np.asarray(x, np.float64) for x in (query, key, value, dout))
    visible = np.asarray(visible, bool)
    heads_q, heads_kv, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    group = heads_q // heads_kv
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)

    def einsum(spec, a, b):
        return np.einsum(spec, a, b, optimize=True)

    logits = np.where(visible, scale * einsum("btnh,bsnh->bnts", q, k_rep), -np.inf)
    row_max = logits.max(-1, keepdims=True)
    weights = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0))
    denom = weights.sum(-1, keepdims=True)
    probs = weights / np.where(denom > 0, denom, 1)
    out = einsum("bnts,bsnh->btnh", probs, v_rep)
    dprobs = einsum("btnh,bsnh->bnts", do, v_rep)
    dlogits = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True))
    dq = scale * einsum("bnts,bsnh->btnh", dlogits, k_rep)

    def sum_groups(x):  # [B, S, N, H] -> [B, S, K, H]
        return x.reshape(*x.shape[:2], heads_kv, group, x.shape[-1]).sum(3)

    dk = sum_groups(scale * einsum("bnts,btnh->bsnh", dlogits, q))
    dv = sum_groups(einsum("bnts,btnh->bsnh", probs, do))
    return [out, dq, dk, dv]
