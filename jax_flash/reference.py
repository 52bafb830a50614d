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
