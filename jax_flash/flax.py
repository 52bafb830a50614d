"""Flax integration: an ``attention_fn`` for Flax's attention layers and a self-contained NNX ``Attention`` module.

``attention_fn`` plugs the jax_flash kernels into ``flax.nnx.MultiHeadAttention(..., attention_fn=...)`` and
``flax.linen.MultiHeadDotProductAttention(attention_fn=...)``::

    import functools
    from flax import linen as nn, nnx
    from jax_flash.flax import attention_fn, make_attention_fn

    causal = functools.partial(attention_fn, is_causal=True)
    layer = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=causal)
    y = layer.apply(params, x)

    layer = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False, attention_fn=attention_fn, rngs=rngs)
    y = layer(x, is_causal=True)  # nnx passes its call's is_causal to attention_fn, overriding a partial's
    layer = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                                   attention_fn=make_attention_fn(is_causal=True), rngs=rngs)
    y = layer(x)  # causal whatever is_causal nnx passes

The kernels express causal, sliding-window and sequence-length masking, not arbitrary dense masks. Flax hands
masks over as traced arrays whose structure is unknown at trace time, so a call with a ``mask`` (or ``bias``) runs
:func:`jax.nn.dot_product_attention` instead and warns once: pass ``is_causal``, ``local_window_size`` or the
sequence lengths instead of a mask to stay on the kernel.

``Attention`` is a grouped-query self-attention layer with rotary embeddings whose ``implementation`` can be
switched between the kernel and jax.nn's implementations on the same parameters. For generation it has a KV-cache
mode: ``init_cache`` makes a :class:`KVCache`, ``prefill`` runs the prompt and fills the cache, ``decode`` runs a
few new tokens against it (:func:`jax_flash.decode_attention`); both return the new cache, which the caller
threads through its step function (donate it under ``jax.jit`` so the update is in place)::

    cache = layer.init_cache(batch, max_len)            # or equal_lengths=True: prompts of one length, unpadded
    y, cache = layer.prefill(prompt_x, cache)           # [B, P, d_model]
    step = jax.jit(lambda x, cache: layer.decode(x, cache), donate_argnums=1)
    y, cache = step(next_x, cache)                      # [B, 1, d_model]

This module needs ``flax`` (``pip install ".[flax]"`` in the repository installs jax_flash with flax and optax);
``import jax_flash`` does not import it.
"""

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax.typing import ArrayLike, DTypeLike

from jax_flash import attention as attention_module
from jax_flash.attention import Implementation, dot_product_attention
from jax_flash.decode import MAX_QUERY_ROWS, decode_attention

__all__ = ["Attention", "KVCache", "apply_rope", "attention_fn", "make_attention_fn"]

IMPLEMENTATIONS = (None, "xla", "cudnn")



def _warn_once(reason, message):
    """One warning per reason and process, shared with jax_flash.attention's fallback warnings."""
    attention_module._warn_once(f"flax:{reason}", message, stacklevel=3)


def _check_implementation(implementation, where=""):
    if callable(implementation):
        raise ValueError(f"{where}a callable implementation is only used by Attention.__call__; this takes None "
                         "(the jax_flash kernel), 'xla' or 'cudnn'")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None (the jax_flash kernel), 'xla' or 'cudnn', got "
                         f"{implementation!r}")
    return implementation


def _check_layer_implementation(implementation):
    """Attention's implementation: one of IMPLEMENTATIONS, or any callable (another attention to compare with)."""
    return implementation if callable(implementation) else _check_implementation(implementation)


def _flatten_lengths(lengths, name, batch_shape):
    """int32 lengths of shape `batch_shape` (also (1,) when there is no batch dim) -> shape (prod(batch_shape),)."""
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    shape_ok = lengths.shape == batch_shape or (batch_shape == () and lengths.shape == (1,))
    if lengths.dtype != jnp.int32 or not shape_ok:
        raise ValueError(f"{name} must be an int32 array of the batch shape {batch_shape}, got shape {lengths.shape} "
                         f"and dtype {lengths.dtype}")
    return lengths.reshape(-1)


def _to_rank4(x, batch_shape):
    """A mask or bias broadcastable to [*batch_shape, heads, q, kv] -> [prod(batch_shape), heads|1, q|1, kv|1]."""
    if x is None:
        return None
    rank = len(batch_shape) + 3
    if x.ndim > rank:
        raise ValueError(f"mask and bias must be broadcastable to [*batch, heads, q_length, kv_length] with batch "
                         f"shape {batch_shape}, got shape {x.shape}")
    x = x.reshape((1,) * (rank - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, batch_shape + x.shape[len(batch_shape):])
    return x.reshape((math.prod(batch_shape),) + x.shape[len(batch_shape):])


def _options_mask(seqlen_q, seqlen_k, local_window_size, query_seq_lengths, key_value_seq_lengths, batch_shape):
    """Bool [*batch_shape or 1s, 1, T, S] mask (True = attend) for the window and lengths; None if neither is set."""
    if local_window_size is None and query_seq_lengths is None and key_value_seq_lengths is None:
        return None
    rows = jnp.arange(seqlen_q)[:, None]
    cols = jnp.arange(seqlen_k)[None, :]
    mask = jnp.ones((seqlen_q, seqlen_k), bool)
    if local_window_size is not None:
        left, right = (local_window_size if isinstance(local_window_size, (tuple, list))
                       else (local_window_size, local_window_size))
        mask &= (cols >= rows - left) & (cols <= rows + right)
    mask = mask.reshape((1,) * len(batch_shape) + (1, seqlen_q, seqlen_k))
    if key_value_seq_lengths is not None:
        lens = key_value_seq_lengths.reshape(batch_shape + (1, 1, 1))
        mask = mask & (jnp.arange(seqlen_k) < lens)
    if query_seq_lengths is not None:
        lens = query_seq_lengths.reshape(batch_shape + (1, 1, 1))
        mask = mask & (jnp.arange(seqlen_q)[:, None] < lens)
    return mask


def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: DTypeLike | None = None,
    precision: jax.lax.PrecisionLike = None,
    module: Any = None,
    promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
    is_causal: bool = False,
    *,
    local_window_size: int | tuple[int, int] | None = None,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    implementation: Implementation = None,
    q_segment_ids: ArrayLike | None = None,
    kv_segment_ids: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    logits_soft_cap: float | None = None,
    **unused: Any,
) -> jax.Array:
    """Dot-product attention through the jax_flash kernels, a drop-in for Flax's ``attention_fn``.

    Takes the arguments that ``flax.nnx.MultiHeadAttention`` and ``flax.linen.MultiHeadDotProductAttention`` pass
    to their ``attention_fn`` (those of :func:`flax.nnx.dot_product_attention`), plus the kernel's own masking
    options, which callers fix with :func:`functools.partial` or :func:`make_attention_fn`.

    Runs :func:`jax_flash.dot_product_attention` unless one of these applies:

    * ``mask`` or ``bias`` is given: the kernels take no dense mask and a traced mask cannot be inspected, so this
      runs :func:`jax.nn.dot_product_attention` (its ``implementation`` is this function's) and warns once. Pass
      ``is_causal=True``, ``local_window_size`` or sequence lengths instead to stay on the kernel.
    * dropout is active (``dropout_rate > 0`` and not ``deterministic``): runs
      :func:`flax.nnx.dot_product_attention` with the same arguments (the options below turned into a mask) and
      warns once.

    Args:
      query: [batch..., q_length, num_heads, head_dim]; any number of batch dims, including none.
      key: [batch..., kv_length, num_kv_heads, head_dim]; num_heads must be a multiple of num_kv_heads.
      value: the shape of key.
      bias: optional additive bias broadcastable to [batch..., num_heads, q_length, kv_length] (falls back).
      mask: optional mask broadcastable to [batch..., num_heads, q_length, kv_length], nonzero = attend (falls
        back).
      broadcast_dropout, dropout_rng, dropout_rate, deterministic: as in Flax; dropout only in the fallback.
      dtype: cast query, key and value to this dtype first; None promotes them to a common dtype.
      precision: used by the dropout fallback only; the kernels accumulate in float32 whatever it is.
      module: set by Flax when attention weights are to be sowed. The kernels never form the weights: nothing
        is sowed (warns once).
      promote_dtype: ``flax.nnx``-style dtype promotion, called as ``promote_dtype((query, key, value),
        dtype=dtype)``.
      is_causal: key j is visible to query i only if j <= i. ``nnx.MultiHeadAttention`` always passes its call's
        ``is_causal`` (default False), overriding a ``functools.partial``; use ``layer(x, is_causal=True)`` or
        :func:`make_attention_fn` there.
      local_window_size: optional int w or (left, right): key j is visible to query i only if
        i - left <= j <= i + right.
      query_seq_lengths: optional int32 array of the batch shape: query rows at or past it output 0.
      key_value_seq_lengths: optional int32 array of the batch shape: keys at or past it are masked.
      implementation: None runs the jax_flash kernels; ``"xla"`` or ``"cudnn"`` run
        :func:`jax.nn.dot_product_attention` with that implementation (``"xla"`` is jax.nn's reference path, for
        A/B checks).
      q_segment_ids, kv_segment_ids: optional int32 [batch..., q_length] / [batch..., kv_length] segment ids of
        packed sequences (kv defaults to q when the lengths are equal); sinks: optional float32 [num_heads]
        attention sinks; logits_soft_cap: optional float cap, as in :func:`jax_flash.dot_product_attention`. They
        cannot be combined with ``mask``, ``bias`` or active dropout (ValueError).
      **unused: other keywords Flax may pass (``force_fp32_for_softmax``, ...), ignored: softmax always runs in
        float32 in the kernels. ``use_kernel`` is refused (TypeError): ``implementation`` is the one choice.

    Returns:
      [batch..., q_length, num_heads, head_dim] in the promoted dtype.

    A query row that sees no key (e.g. every key masked by the lengths) outputs 0 in the kernel, where Flax's and
    jax.nn's implementations average the values uniformly.
    """
    if "use_kernel" in unused:
        raise TypeError("attention_fn takes no use_kernel; choose with implementation=None (the kernel), 'xla' or "
                        "'cudnn'")
    if unused.get("input_positions") is not None:  # (flax's dot_product_attention_with_rope rotates q and k by them)
        raise TypeError("attention_fn applies no rotary embedding: input_positions would be ignored; rotate q and k "
                        "before the call (jax_flash.flax.apply_rope) or use jax_flash.flax.Attention(rope=True)")
    del unused
    _check_implementation(implementation)
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(f"query, key and value must have one rank >= 3 ([batch..., length, heads, head_dim]), got "
                         f"shapes {query.shape}, {key.shape}, {value.shape}")
    if mask is not None and (is_causal or local_window_size is not None) and query.shape[-3] < key.shape[-3]:
        raise ValueError("jax_flash.flax.attention_fn: is_causal or local_window_size with a mask over fewer query "
                         f"rows ({query.shape[-3]}) than keys ({key.shape[-3]}), as in Flax's decode=True cache "
                         "step, would align the causal mask top-left and show the query rows the first keys only; "
                         "there pass neither (Flax's cache mask already hides the future), or use "
                         "jax_flash.flax.Attention's prefill / decode")
    batch_shape = query.shape[:-3]
    if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
        raise ValueError(f"query, key and value batch dims must match, got shapes {query.shape}, {key.shape}, "
                         f"{value.shape}")
    q_lens = _flatten_lengths(query_seq_lengths, "query_seq_lengths", batch_shape)
    kv_lens = _flatten_lengths(key_value_seq_lengths, "key_value_seq_lengths", batch_shape)
    extras = {name: x for name, x in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids),
                                      ("sinks", sinks), ("logits_soft_cap", logits_soft_cap)) if x is not None}
    if extras and (mask is not None or bias is not None or (dropout_rate > 0.0 and not deterministic)):
        raise ValueError(f"jax_flash.flax.attention_fn: {', '.join(extras)} cannot be combined with a dense mask, "
                         "a bias or active dropout (those run jax.nn or flax, which do not take them)")
    for name in ("q_segment_ids", "kv_segment_ids"):
        if name in extras:
            ids = jnp.asarray(extras[name])
            if ids.shape[:-1] != batch_shape:
                raise ValueError(f"{name} must have shape batch dims + (length,) = {batch_shape} + (length,), got "
                                 f"{ids.shape}")
            extras[name] = ids.reshape((math.prod(batch_shape), ids.shape[-1]))
    if module is not None:
        _warn_once("sow", "jax_flash.flax.attention_fn: the fused kernels never form the attention weights; "
                          "nothing is sowed.")

    if dropout_rate > 0.0 and not deterministic:
        _warn_once("dropout", "jax_flash.flax.attention_fn: the kernels have no attention dropout; running "
                              "flax.nnx.dot_product_attention instead while dropout is active.")
        options_mask = _options_mask(
            query.shape[-3], key.shape[-3], local_window_size,
            None if q_lens is None else q_lens.reshape(batch_shape),
            None if kv_lens is None else kv_lens.reshape(batch_shape), batch_shape)
        if options_mask is not None:
            mask = options_mask if mask is None else jnp.logical_and(mask.astype(bool), options_mask)
        out = nnx.dot_product_attention(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic,
            precision=precision, is_causal=is_causal)
        if q_lens is not None:
            valid = jnp.arange(query.shape[-3]) < q_lens.reshape(batch_shape + (1,))
            out = jnp.where(valid[..., None, None], out, 0).astype(out.dtype)
        return out

    out_shape = query.shape
    flat = lambda x: x.reshape((math.prod(batch_shape),) + x.shape[-3:])
    query, key, value = flat(query), flat(key), flat(value)
    if mask is None and bias is None:
        out = dot_product_attention(
            query, key, value, is_causal=is_causal, local_window_size=local_window_size,
            query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens, implementation=implementation, **extras)
    else:
        reason = "a dense mask" if bias is None else "an attention bias"
        _warn_once(f"dense:{reason}",
                   f"jax_flash.flax.attention_fn: the kernels cannot take {reason}; running "
                   f"jax.nn.dot_product_attention instead. To stay on the kernel, express causal, sliding-window "
                   f"or padding masks as is_causal=True / local_window_size / query_seq_lengths and "
                   f"key_value_seq_lengths, e.g. functools.partial(jax_flash.flax.attention_fn, is_causal=True).")
        mask = _to_rank4(mask, batch_shape)
        out = jax.nn.dot_product_attention(
            query, key, value, _to_rank4(bias, batch_shape), None if mask is None else mask.astype(bool),
            is_causal=is_causal, local_window_size=local_window_size, query_seq_lengths=q_lens,
            key_value_seq_lengths=kv_lens, implementation=implementation)
    return out.reshape(out_shape)


def make_attention_fn(*, is_causal: bool = False, local_window_size: int | tuple[int, int] | None = None,
                      implementation: Implementation = None) -> Callable[..., jax.Array]:
    """``attention_fn`` with its masking options and implementation fixed.

    Unlike ``functools.partial(attention_fn, is_causal=True)``, ``is_causal=True`` here holds even when the caller
    passes ``is_causal=False``, as ``flax.nnx.MultiHeadAttention`` always does unless called with
    ``is_causal=True``. The returned function keeps :func:`attention_fn`'s signature, which
    ``flax.linen.MultiHeadDotProductAttention`` inspects to decide which keywords to pass.
    """
    _check_implementation(implementation)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    fixed = dict(is_causal=bool(is_causal), local_window_size=local_window_size, implementation=implementation)

    @functools.wraps(attention_fn)
    def fn(*args, **kwargs):
        kwargs["is_causal"] = fixed["is_causal"] or bool(kwargs.get("is_causal", False))
        kwargs.setdefault("local_window_size", fixed["local_window_size"])
        kwargs.setdefault("implementation", fixed["implementation"])
        return attention_fn(*args, **kwargs)

    return fn


def apply_rope(x: jax.Array, positions: ArrayLike, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding, LLaMA's half-rotation convention, computed in float32.

    Dimension i < head_dim / 2 of every head is rotated together with dimension i + head_dim / 2 by the angle
    ``position * theta ** (-2 i / head_dim)``.

    Args:
      x: [batch, seq, heads, head_dim], head_dim even.
      positions: integer positions, [seq] or [batch, seq].
      theta: the base of the rotation frequencies.

    Returns:
      x rotated, in x's dtype.
    """
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(f"x must be [batch, seq, heads, head_dim] with an even head_dim, got shape {x.shape}")
    positions = jnp.asarray(positions)
    if positions.shape not in ((x.shape[1],), x.shape[:2]):
        raise ValueError(f"positions must have shape (seq,) = ({x.shape[1]},) or (batch, seq) = {x.shape[:2]}, got "
                         f"{positions.shape}")
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [(batch,) seq, 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _prompt_lengths(lengths, batch, seqlen):
    """prefill's ``lengths`` as int32 [batch], each in [0, seqlen] where the values are known."""
    dtype = attention_module._dtype_of(lengths)
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"lengths must be int32, got {dtype}")
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape (batch,) = ({batch},), got {lengths.shape}")
    values = attention_module._concrete(lengths)
    if values is not None and ((values < 0) | (values > seqlen)).any():
        raise ValueError(f"lengths must lie in [0, {seqlen}] (the prompt's length), got {values.tolist()}")
    return lengths.astype(jnp.int32)


class KVCache(NamedTuple):
    """One attention layer's key/value cache (a pytree): ``k``, ``v`` [batch, max_len, num_kv_heads, head_dim] and
    ``lengths`` int32 [batch], the valid entries of each sequence (the next token's position), or int32 [] when
    every sequence is equally long (``init_cache(..., equal_lengths=True)``)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array


def _write_cache(cache, k, v, start):
    """The cache with k, v [B, T, H, D] written at each sequence's position ``start`` [B], or [] for one position of
    every sequence (dynamic_update_slice per sequence, or one for the batch: in place when the cache is donated).
    Writes past the end are clipped by XLA to the last positions; callers keep lengths within max_len."""
    if jnp.ndim(start) == 0:
        at = (0, start, 0, 0)
        return (jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), at),
                jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), at))

    def one(ck, cv, k, v, s):
        return (jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (s, 0, 0)),
                jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (s, 0, 0)))
    ck, cv = jax.vmap(one)(cache.k, cache.v, k, v, start)
    return ck, cv


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings, run by the jax_flash kernels.

    Projections ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` are bias-free :class:`flax.nnx.Linear` layers.
    ``implementation`` only picks the attention computation, so parameters (and checkpoints) are the same for
    every choice, and it can be changed on a built module (``layer.implementation = "xla"``) to compare the
    kernel with jax.nn on the same weights.

    Args:
      d_model: model (input and output) width.
      num_heads: query heads.
      num_kv_heads: key/value heads, dividing num_heads (grouped-query attention); default num_heads.
      head_dim: per-head width; default d_model // num_heads. The kernels take multiples of 8 up to 256.
      is_causal: causal self-attention.
      local_window_size: optional int w or (left, right) sliding window, as in
        :func:`jax_flash.dot_product_attention`.
      rope: apply rotary embeddings (:func:`apply_rope`) to queries and keys.
      rope_theta: the base of the rotary frequencies.
      implementation: None runs the jax_flash kernels; ``"xla"`` or ``"cudnn"`` run
        :func:`jax.nn.dot_product_attention` with that implementation (``"xla"`` is jax.nn's reference path, for
        A/B checks; they take no sinks, soft cap or segment ids). A callable ``f(q, k, v, *, is_causal) -> out``
        (all ``[batch, seq, heads, head_dim]``, k and v with ``num_kv_heads``) runs another attention on the same
        weights, e.g. a third-party kernel to compare with; it is used by ``__call__`` only, without windows,
        lengths, segment ids, sinks or a soft cap.
      sinks: own a float32 [num_heads] parameter ``sinks`` (initialised to 0): attention sinks (gpt-oss).
      logits_soft_cap: optional static float c > 0: logits become c * tanh(logits / c) (Gemma 2).
      dtype: computation dtype of the projections and the attention (the kernels take bfloat16 and float16, and
        float32 on CPU); None promotes inputs and parameters.
      param_dtype: parameter dtype.
      kernel_init: initializer of the projection matrices.
      rngs: random number streams for the initializers.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        is_causal: bool = True,
        local_window_size: int | tuple[int, int] | None = None,
        rope: bool = True,
        rope_theta: float = 10000.0,
        implementation: Implementation | Callable[..., jax.Array] = None,
        sinks: bool = False,
        logits_soft_cap: float | None = None,
        dtype: DTypeLike | None = jnp.bfloat16,
        param_dtype: DTypeLike = jnp.float32,
        kernel_init: jax.nn.initializers.Initializer = nnx.initializers.lecun_normal(),
        rngs: nnx.Rngs,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, n in (("d_model", d_model), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model ({d_model}) must be a multiple of num_heads ({num_heads}) unless head_dim "
                                 "is given")
            head_dim = d_model // num_heads
        if not isinstance(head_dim, int) or head_dim < 1 or (rope and head_dim % 2):
            raise ValueError(f"head_dim must be a positive int, even with rope, got {head_dim!r}")
        if not isinstance(is_causal, (bool, np.bool_)):
            raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.is_causal = bool(is_causal)
        self.local_window_size = local_window_size
        self.rope, self.rope_theta = bool(rope), float(rope_theta)
        self.implementation = _check_layer_implementation(implementation)
        self.logits_soft_cap = attention_module._check_soft_cap(logits_soft_cap)
        self.sinks = nnx.Param(jnp.zeros((num_heads,), jnp.float32)) if sinks else None
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                   kernel_init=kernel_init, rngs=rngs)
        self.q_proj = linear(d_model, num_heads * head_dim)
        self.k_proj = linear(d_model, num_kv_heads * head_dim)
        self.v_proj = linear(d_model, num_kv_heads * head_dim)
        self.o_proj = linear(num_heads * head_dim, d_model)

    def __call__(self, x: jax.Array, *, positions: ArrayLike | None = None,
                 query_seq_lengths: ArrayLike | None = None,
                 key_value_seq_lengths: ArrayLike | None = None,
                 segment_ids: ArrayLike | None = None) -> jax.Array:
        """Self-attention over x.

        Args:
          x: [batch, seq, d_model].
          positions: integer positions for the rotary embeddings, [seq] or [batch, seq]; default 0, 1, ...
          query_seq_lengths: optional int32 [batch]: rows at or past it output 0 (before ``o_proj``).
          key_value_seq_lengths: optional int32 [batch]: keys at or past it are masked (right padding).
          segment_ids: optional int32 [batch, seq]: packed sequences; a token sees only tokens of its segment
            (pass ``positions`` that restart at each segment for the rotary embeddings).

        Returns:
          [batch, seq, d_model].
        """
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, seq, d_model={self.d_model}], got shape {x.shape}")
        batch, seqlen, _ = x.shape
        q = self.q_proj(x).reshape(batch, seqlen, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, seqlen, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, seqlen, self.num_kv_heads, self.head_dim)
        if self.rope:
            positions = jnp.arange(seqlen) if positions is None else positions
            q = apply_rope(q, positions, self.rope_theta)
            k = apply_rope(k, positions, self.rope_theta)
        elif positions is not None:
            raise ValueError("positions are only used with rope=True")
        implementation = _check_layer_implementation(self.implementation)
        if callable(implementation):
            options = {name: value for name, value in (
                ("local_window_size", self.local_window_size), ("query_seq_lengths", query_seq_lengths),
                ("key_value_seq_lengths", key_value_seq_lengths), ("segment_ids", segment_ids),
                ("sinks", self.sinks), ("logits_soft_cap", self.logits_soft_cap)) if value is not None}
            if options:
                raise ValueError(f"a callable implementation takes q, k, v and is_causal only, not "
                                 f"{', '.join(options)}")
            out = implementation(q, k, v, is_causal=self.is_causal)
            return self.o_proj(out.reshape(batch, seqlen, self.num_heads * self.head_dim))
        out = dot_product_attention(
            q, k, v, is_causal=self.is_causal, local_window_size=self.local_window_size,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            implementation=implementation, q_segment_ids=segment_ids,
            sinks=None if self.sinks is None else self.sinks[...], logits_soft_cap=self.logits_soft_cap)
        return self.o_proj(out.reshape(batch, seqlen, self.num_heads * self.head_dim))

    # -- KV-cache generation ------------------------------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype: DTypeLike | None = None, *,
                   equal_lengths: bool = False) -> KVCache:
        """An empty cache for `batch` sequences of up to `max_len` tokens (dtype: the layer's ``dtype``, else
        bfloat16). ``equal_lengths``: every sequence stays equally long (prompts of one length, no padding, one
        token each a step), kept as one length (``lengths`` int32 []): ``prefill`` then takes no per-sequence
        ``lengths``, the cache updates are one slice for the batch, and the decode kernels split the keys for equal
        lengths (``decode_attention`` with one length; on an H200 one kernel without a combine where the batch's
        (sequence, kv head) pairs fill the GPU, as at batch 16 of LLaMA-3-8B)."""
        if not isinstance(equal_lengths, (bool, np.bool_)):
            raise TypeError(f"equal_lengths must be a bool, got {type(equal_lengths).__name__}")
        for name, n in (("batch", batch), ("max_len", max_len)):
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {n!r}")
            if n < 0:
                raise ValueError(f"{name} must be >= 0, got {n}")
        dtype = dtype or self.q_proj.dtype or jnp.bfloat16
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        lengths = jnp.zeros((), jnp.int32) if equal_lengths else jnp.zeros((batch,), jnp.int32)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), lengths)

    def _project(self, x, positions):
        batch, seqlen, _ = x.shape
        q = self.q_proj(x).reshape(batch, seqlen, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, seqlen, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, seqlen, self.num_kv_heads, self.head_dim)
        if self.rope:
            q = apply_rope(q, positions, self.rope_theta)
            k = apply_rope(k, positions, self.rope_theta)
        return q, k, v

    def _check_cache_input(self, x, cache):
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, seq, d_model={self.d_model}], got shape {x.shape}")
        if not isinstance(cache, KVCache) or cache.k.shape[0] != x.shape[0]:
            raise ValueError("cache must be a KVCache from init_cache for this batch")
        if cache.k.shape[2:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"cache heads/head_dim {cache.k.shape[2:]} differ from the layer's "
                             f"({self.num_kv_heads}, {self.head_dim})")

    def prefill(self, x: jax.Array, cache: KVCache, *, lengths: ArrayLike | None = None
                ) -> tuple[jax.Array, KVCache]:
        """Causal self-attention over the prompt x [batch, P, d_model] (positions 0..P-1), with its keys and values
        written to the start of the cache. ``lengths`` (int32 [batch], default P): prompts right-padded to P;
        rows past a prompt's length output 0 and the cache counts only its length (not for a cache of
        ``equal_lengths``, whose prompts all have P tokens); a length outside [0, P] raises where it is known and
        gives that sequence nan outputs where it is traced.

        Returns (y [batch, P, d_model], the cache)."""
        self._check_cache_input(x, cache)
        if not self.is_causal:
            raise ValueError("prefill needs a causal layer (is_causal=True), as decode does")
        batch, seqlen, _ = x.shape
        if seqlen > cache.k.shape[1]:
            raise ValueError(f"the prompt ({seqlen} tokens) does not fit the cache ({cache.k.shape[1]})")
        equal = cache.lengths.ndim == 0
        if equal and lengths is not None:
            raise ValueError("a cache of equal_lengths (init_cache(..., equal_lengths=True)) takes prompts of one "
                             "length: prefill without `lengths`")
        lengths = jnp.full((batch,), seqlen, jnp.int32) if lengths is None else _prompt_lengths(lengths, batch, seqlen)
        q, k, v = self._project(x, jnp.arange(seqlen))
        out = dot_product_attention(
            q, k, v, is_causal=True, local_window_size=self.local_window_size, query_seq_lengths=lengths,
            key_value_seq_lengths=lengths, implementation=_check_implementation(self.implementation, "prefill: "),
            sinks=None if self.sinks is None else self.sinks[...], logits_soft_cap=self.logits_soft_cap)
        ck, cv = _write_cache(cache, k, v, jnp.zeros((), jnp.int32) if equal else jnp.zeros((batch,), jnp.int32))
        y = self.o_proj(out.reshape(batch, seqlen, self.num_heads * self.head_dim))
        # traced lengths outside [0, P] (concrete ones raise): that sequence's outputs are nan, not a wrong answer
        bad = (lengths < 0) | (lengths > seqlen)
        y = jnp.where(bad[:, None, None], jnp.asarray(jnp.nan, y.dtype), y)
        return y, KVCache(ck, cv, jnp.asarray(seqlen, jnp.int32) if equal else lengths)

    def decode(self, x: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """The next Tq <= 16 tokens x [batch, Tq, d_model] of each sequence, at positions ``cache.lengths + t``:
        their keys and values are appended to the cache, then each attends (causally) to its sequence's cache
        (:func:`jax_flash.decode_attention`; with ``implementation="xla"`` or ``"cudnn"``, jax.nn with the same
        mask). The caller keeps ``cache.lengths + Tq`` within the cache's max_len: eager calls past it raise, traced
        ones give that sequence nan outputs (the cache writes were clipped onto its last slots).

        Returns (y [batch, Tq, d_model], the cache with the new entries)."""
        self._check_cache_input(x, cache)
        if not self.is_causal:
            raise ValueError("decode needs a causal layer (is_causal=True)")
        batch, rows, _ = x.shape
        if not 1 <= rows <= MAX_QUERY_ROWS:
            raise ValueError(f"decode takes 1 to {MAX_QUERY_ROWS} new tokens, got {rows}")
        # (eager calls; under jit the caller keeps within max_len, as documented)
        filled = attention_module._concrete(cache.lengths)
        if filled is not None and (filled + rows > cache.k.shape[1]).any():
            raise ValueError(f"the cache is full: cache.lengths + {rows} new tokens = {(filled + rows).tolist()} "
                             f"exceed its max_len {cache.k.shape[1]}")
        positions = cache.lengths[..., None] + jnp.arange(rows, dtype=jnp.int32)  # [batch, rows], or [rows]
        q, k, v = self._project(x, positions)
        ck, cv = _write_cache(cache, k, v, cache.lengths)
        lengths = cache.lengths + rows  # [] for a cache of equal lengths: decode_attention's one length
        implementation = _check_implementation(self.implementation, "decode: ")
        sinks = None if self.sinks is None else self.sinks[...]
        if implementation is not None and (sinks is not None or self.logits_soft_cap is not None):
            raise ValueError(f"sinks and logits_soft_cap are jax_flash options: implementation={implementation!r} "
                             "(jax.nn) does not take them")
        q = q.astype(ck.dtype)  # (a cache of another dtype than the layer's compute: init_cache(dtype=...))
        if implementation is None:
            out = decode_attention(q, ck, cv, lengths, local_window_size=self.local_window_size, sinks=sinks,
                                   logits_soft_cap=self.logits_soft_cap)
        elif rows == 1 and self.local_window_size is None:
            out = jax.nn.dot_product_attention(q, ck, cv, key_value_seq_lengths=jnp.broadcast_to(lengths, (batch,)),
                                               implementation=implementation)
        else:  # bottom-right causal (and window) as a dense mask
            pos = jnp.broadcast_to(positions, (batch, rows))[:, None, :, None]
            key = jnp.arange(ck.shape[1], dtype=jnp.int32)[None, None, None, :]
            visible = (key <= pos) & (key < jnp.broadcast_to(lengths, (batch,))[:, None, None, None])
            if self.local_window_size is not None:
                left, right = attention_module._check_window(self.local_window_size)
                visible &= (key >= pos - left) & (key <= pos + right)
            out = jax.nn.dot_product_attention(q, ck, cv, mask=visible, implementation=implementation)
        y = self.o_proj(out.reshape(batch, rows, self.num_heads * self.head_dim))
        # Past max_len (traced lengths: no error is possible) the writes were clipped onto the last slots: the
        # sequence's outputs are nan rather than a wrong answer.
        over = jnp.broadcast_to(lengths > cache.k.shape[1], (batch,))
        y = jnp.where(over[:, None, None], jnp.asarray(jnp.nan, y.dtype), y)
        return y, KVCache(ck, cv, lengths)
