"""A LLaMA-style decoder in Flax NNX whose attention runs through jax_flash.

The model: token embedding, a stack of pre-norm blocks (RMSNorm, grouped-query causal self-attention with rotary
embeddings through ``jax_flash.flax.Attention``, RMSNorm, SwiGLU MLP, residual connections), a final RMSNorm and an
untied LM head. ``--attention`` switches only the attention computation, on the same parameters: ``jax_flash``
(the fused kernels), ``cudnn`` / ``xla`` (``jax.nn.dot_product_attention`` with that implementation), or the JAX
peers where installed (GPU only; train, check and bench modes): ``fa3_jax`` (``flash_attn3_jax.flash_mha``, PyPI
flash-attn3-jax, head dim 128) and ``tokamax`` (``tokamax.dot_product_attention(implementation="mosaic")``). By
default every choice that can run here is taken; a peer that is not installed is skipped with a note.

Modes (default: ``bench`` when JAX's default device is a GPU, ``train`` otherwise):

* ``train``: trains a tiny decoder with Adam on synthetic sequences (arithmetic progressions mod the vocabulary,
  a random start and stride per sequence) and prints the falling loss. ``--packed N`` packs N such documents into
  each row, with segment ids (each token attends within its document) and positions restarting per document.
* ``check``: for one LLaMA-3-8B-like block (``--config``), computes the loss and the gradients of a train step
  with each attention choice and compares them with the first choice's: the relative differences of the loss and
  of all gradients together must stay below ``--check-tol`` (2e-2), that of each gradient group (the q, k, v, o
  projections, the MLP matrices, the norms, the block input) below ``--check-group-tol`` (5e-2).
* ``bench``: the check, then times the train step of the block (forward, the loss ``0.5 * mean(block(x)^2)``,
  backward to the gradients of the parameters and of the block input, all under ``jax.jit``) for each attention
  choice at B x S = 2 x 4096 and 1 x 8192, and writes the results to
  ``<out>/llama_block-<device>-<date>.{json,md}`` (``--out``: benchmarks/results/ on a GPU; without one the run is a
  smoke run, whose timings are not performance numbers, and goes to ``<temp dir>/jax_flash_bench/``, outside the
  source tree). MFU is reported against ``--peak-tflops``, or else on a known GPU (GPU_PEAK_TFLOPS) against its
  dense bfloat16/float16 peak, for bfloat16 and float16 steps; not otherwise. The step times come from
  ``--rounds`` (5 on a GPU) interleaved rounds in one process: each round times ``--steps`` steps of every
  attention in turn, the order rotated each round, and a row reports the median of its rounds' medians and their
  spread (the GPU's clock drifts by a few percent over a run, more than the attentions differ in a block step).
  By default each shape's check, each (shape, attention) compilation and memory measurement, and each shape's
  rounds run in a child process of their own, so that the peak device memory (``peak_bytes_in_use``, which cannot
  be reset) is that measurement's own; ``--no-isolate`` runs everything in this process and reports the process
  peak so far.

* ``generate``: a LLaMA-3-8B-like stack (``--config``; tiny without a GPU) on random weights: a B x P prompt
  (``--batch``, ``--seq``; default 16 x 4096 on a GPU) prefilled through ``jax_flash.flax.Attention.prefill``,
  then ``--steps`` (64) tokens a sequence, the first from the prefill and the rest by greedy decode steps of one
  token per sequence through the layers' KV caches
  (``Attention.decode``: ``jax_flash.decode_attention``, or jax.nn for cudnn / xla), the caches donated so that
  ``dynamic_update_slice`` writes them in place. The prompts are of one length, so the caches keep one length for
  the batch (``init_cache(equal_lengths=True)``; ``--cache-lengths per-sequence`` keeps one per sequence).
  Reports decode tokens/s for each ``--attention`` in the same run and writes
  ``<out>/generate-<device>-<date>.{json,md}``.

Model FLOPs of one train step (the basis of TFLOP/s and MFU, recomputation not counted):
``6 * P * B * S + 3 * F_attn``, where P is the number of weights in the block's matmuls (the q, k, v, o
projections and the three MLP matrices; 2 FLOPs per weight and token forward, 4 backward for the gradients of
inputs and weights) and ``F_attn = 4 * B * S^2 * Hq * D / 2`` the causal attention forward (QK^T and PV; the
backward counts twice the forward). RMSNorm, RoPE, SwiGLU's elementwise work and the loss are not counted.

    python examples/llama_block.py                                # train on CPU, bench on GPU
    python examples/llama_block.py --mode train --attention xla --steps 50
    python examples/llama_block.py --mode train --packed 4       # 4 documents per row, segment ids
    python examples/llama_block.py --mode check --config tiny
    python examples/llama_block.py --mode bench --batch 1 --seq 8192 --attention jax_flash cudnn
    python examples/llama_block.py --mode bench --dry-run          # lower every step at full size, run nothing
    python examples/llama_block.py --mode generate --batch 16 --seq 4096 --steps 64
"""

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flash
from jax_flash.flax import Attention



def fa3_jax_attention(q, k, v, *, is_causal):
    """FlashAttention-3 as a JAX op (PyPI flash-attn3-jax), as a callable implementation of Attention."""
    import flash_attn3_jax
    return flash_attn3_jax.flash_mha(q, k, v, is_causal=is_causal)


def tokamax_attention(q, k, v, *, is_causal):
    """tokamax's Mosaic GPU attention, as a callable implementation of Attention."""
    import tokamax
    return tokamax.dot_product_attention(q, k, v, is_causal=is_causal, implementation="mosaic")


# --attention -> Attention(implementation=...)
ATTENTION = {"jax_flash": None, "cudnn": "cudnn", "xla": "xla", "fa3_jax": fa3_jax_attention,
             "tokamax": tokamax_attention}
PEER_MODULES = {"fa3_jax": "flash_attn3_jax", "tokamax": "tokamax"}
GPU_ONLY = ("cudnn", "fa3_jax", "tokamax")
MODES = ("train", "check", "bench", "multi", "generate")
# Dense bfloat16/float16 tensor-core peaks of known GPUs, by JAX device_kind: (TFLOP/s, model), for MFU.
GPU_PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": (989.0, "H100 SXM"),
    "NVIDIA H200": (989.0, "H200 SXM"),
    "NVIDIA A100-SXM4-80GB": (312.0, "A100 SXM"),
    "NVIDIA A100-SXM4-40GB": (312.0, "A100 SXM"),
}
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks", "results")  # GPU
SMOKE_OUT = os.path.join(tempfile.gettempdir(), "jax_flash_bench")  # bench results without a GPU

log = functools.partial(print, flush=True)


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def matmul_params(self):
        """Weights in one block's matmuls: the attention projections and the three MLP matrices."""
        attn = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attn + 3 * self.d_model * self.mlp_dim


CONFIGS = {
    "tiny": Config(vocab=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384,
                   rope_theta=10000.0),
    "llama3-8b": Config(vocab=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                        mlp_dim=14336, rope_theta=500000.0),
}
BENCH_SHAPES = {"tiny": [(4, 128), (2, 256)], "llama3-8b": [(2, 4096), (1, 8192)]}


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg, *, dtype, param_dtype, rngs):
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                   kernel_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.gate_proj = linear(cfg.d_model, cfg.mlp_dim)
        self.up_proj = linear(cfg.d_model, cfg.mlp_dim)
        self.down_proj = linear(cfg.mlp_dim, cfg.d_model)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg, *, attention="jax_flash", dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs):
        norm = functools.partial(nnx.RMSNorm, cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)
        self.attn_norm = norm()
        self.attn = Attention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, is_causal=True,
                              rope_theta=cfg.rope_theta, implementation=ATTENTION[attention], dtype=dtype,
                              param_dtype=param_dtype, kernel_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions=None, segment_ids=None):
        h = x + self.attn(self.attn_norm(x), positions=positions, segment_ids=segment_ids)
        return h + self.mlp(self.mlp_norm(h))

    def prefill(self, x, cache):
        y, cache = self.attn.prefill(self.attn_norm(x), cache)
        h = x + y
        return h + self.mlp(self.mlp_norm(h)), cache

    def decode(self, x, cache):
        y, cache = self.attn.decode(self.attn_norm(x), cache)
        h = x + y
        return h + self.mlp(self.mlp_norm(h)), cache


class Decoder(nnx.Module):
    """Token embedding, cfg.num_layers blocks, final RMSNorm and an untied LM head; returns float32 logits."""

    def __init__(self, cfg, *, attention="jax_flash", dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dtype, param_dtype=param_dtype,
                               embedding_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.layers = nnx.List([Block(cfg, attention=attention, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.final_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
                                      rngs=rngs)
        self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                  kernel_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)

    def __call__(self, tokens, positions=None, segment_ids=None):
        """tokens [B, S]; for packed rows, segment_ids [B, S] and positions [B, S] that restart at each document."""
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, positions=positions, segment_ids=segment_ids)
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)

    def init_caches(self, batch, max_len, equal_lengths=False):
        """One empty jax_flash.flax.KVCache per layer (``equal_lengths``: every sequence equally long, one length)."""
        return [block.attn.init_cache(batch, max_len, equal_lengths=equal_lengths) for block in self.layers]

    def _cached(self, method, tokens, caches, last_only=False):
        x, new = self.embed(tokens), []
        for block, cache in zip(self.layers, caches):
            x, cache = getattr(block, method)(x, cache)
            new.append(cache)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.final_norm(x)).astype(jnp.float32), new

    def prefill(self, tokens, caches):
        """The prompt tokens [B, P] (positions 0..P-1) through every layer, filling the caches: (logits of the last
        position [B, 1, vocab], caches)."""
        return self._cached("prefill", tokens, caches, last_only=True)

    def decode(self, tokens, caches):
        """The next tokens [B, T] (T <= 16) at the caches' positions: (logits [B, T, vocab], caches)."""
        return self._cached("decode", tokens, caches)


def unavailable(attention, on_gpu):
    """Why `attention` cannot run here (GPU only, or a peer that does not import), or None."""
    if attention in GPU_ONLY and not on_gpu:
        return "GPU only"
    module = PEER_MODULES.get(attention)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is not usable
        return f"not installed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


def choose_attentions(args, error, on_gpu, allowed):
    """--attention, or every choice in `allowed` that can run here (peers that do not import noted in
    args.skipped); a choice the user named that cannot run is an error."""
    args.skipped = {}
    if args.attention is not None:
        for a in args.attention:
            if a not in allowed:
                error(f"--mode {args.mode} takes --attention {' / '.join(allowed)}, got {a}")
            why = unavailable(a, on_gpu)
            if why:
                error(f"--attention {a}: {why}")
        if len(set(args.attention)) != len(args.attention):
            error("--attention lists a choice twice")
        return args.attention
    chosen = []
    for a in allowed:
        why = unavailable(a, on_gpu)
        if why:
            if a in PEER_MODULES and on_gpu:
                log(f"note: --attention {a} skipped: {why}")
                args.skipped[a] = why
        else:
            chosen.append(a)
    return chosen


def set_attention(module, attention):
    """Switches every jax_flash.flax.Attention inside `module` to `attention` (a key of ATTENTION)."""
    for _, sub in nnx.iter_graph(module):
        if isinstance(sub, Attention):
            sub.implementation = ATTENTION[attention]


def device_info():
    device = jax.devices()[0]
    return device, device.device_kind, device.platform == "gpu"


# ----------------------------------------------------------------------------------------------------------------
# train


def progression_batch(key, batch, seqlen, vocab, max_stride=4):
    """[batch, seqlen + 1] int32 arithmetic progressions mod vocab: random start, random stride in 1..max_stride."""
    k_start, k_stride = jax.random.split(key)
    start = jax.random.randint(k_start, (batch, 1), 0, vocab)
    stride = jax.random.randint(k_stride, (batch, 1), 1, max_stride + 1)
    return ((start + stride * jnp.arange(seqlen + 1)) % vocab).astype(jnp.int32)


def packed_progression_batch(key, batch, seqlen, vocab, docs, max_stride=4):
    """(tokens, segment_ids, positions), each [batch, seqlen + 1] int32: every row packs `docs` arithmetic
    progressions of random lengths (cut points drawn per row), each with its own start and stride; positions
    restart at 0 in each document."""
    k_cut, k_start, k_stride = jax.random.split(key, 3)
    cut_keys = jax.random.split(k_cut, batch)
    cuts = jax.vmap(lambda k: jnp.sort(jax.random.choice(k, jnp.arange(1, seqlen + 1), (docs - 1,),
                                                         replace=False)))(cut_keys)
    index = jnp.arange(seqlen + 1)
    segment = jax.vmap(lambda c: jnp.searchsorted(c, index, side="right"))(cuts).astype(jnp.int32)
    first = jnp.concatenate([jnp.zeros((batch, 1), cuts.dtype), cuts], axis=1)  # [batch, docs]: each doc's start
    positions = (index - jnp.take_along_axis(first, segment, axis=1)).astype(jnp.int32)
    start = jax.random.randint(k_start, (batch, docs), 0, vocab)
    stride = jax.random.randint(k_stride, (batch, docs), 1, max_stride + 1)
    pick = lambda x: jnp.take_along_axis(x, segment, axis=1)  # noqa: E731
    tokens = ((pick(start) + pick(stride) * positions) % vocab).astype(jnp.int32)
    return tokens, segment, positions


def cross_entropy(model, batch):
    """Next-token loss; for packed rows (tokens, segment_ids, positions) the tokens see only their own document
    (segment ids) and the first token of a document is not predicted from the one before."""
    if not isinstance(batch, tuple):
        logits = model(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    tokens, segment, positions = batch
    logits = model(tokens[:, :-1], positions=positions[:, :-1], segment_ids=segment[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    same = (segment[:, :-1] == segment[:, 1:]).astype(losses.dtype)
    return jnp.sum(losses * same) / jnp.maximum(jnp.sum(same), 1)


@nnx.jit
def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(cross_entropy)(model, batch)
    optimizer.update(model, grads)
    return loss


def train(args):
    cfg = CONFIGS[args.config]
    attention = args.attention[0]
    dtype = jnp.dtype(args.dtype)
    _, kind, _ = device_info()
    model = Decoder(cfg, attention=attention, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
    if args.packed > 1:
        make_batch = jax.jit(functools.partial(packed_progression_batch, batch=args.batch, seqlen=args.seq,
                                               vocab=cfg.vocab, docs=args.packed))
    else:
        make_batch = jax.jit(functools.partial(progression_batch, batch=args.batch, seqlen=args.seq,
                                               vocab=cfg.vocab))
    log(f"{kind} | jax {jax.__version__} | attention {attention} | {cfg.num_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.num_heads} q / {cfg.num_kv_heads} kv heads x {cfg.head_dim}, {n_params / 1e6:.2f}M params, "
        f"{dtype.name} activations | batch {args.batch} x seq {args.seq}, adam lr {args.lr}, {args.steps} steps")
    log(f"task: next token of arithmetic progressions mod {cfg.vocab} (uniform guess: loss {math.log(cfg.vocab):.2f})"
        + (f"; {args.packed} documents packed per row, attention within each (segment ids)" if args.packed > 1
           else ""))
    key = jax.random.key(args.seed + 1)
    losses = []
    for step in range(1, args.steps + 1):
        key, sub = jax.random.split(key)
        tokens = make_batch(sub)
        t0 = time.perf_counter()
        loss = float(train_step(model, optimizer, tokens))
        dt = time.perf_counter() - t0
        losses.append(loss)
        note = " (includes compilation)" if step == 1 else f", {args.batch * args.seq / dt:,.0f} tokens/s"
        log(f"step {step:4d}/{args.steps}  loss {loss:.4f}  {dt * 1e3:8.1f} ms{note}")
    if not all(math.isfinite(x) for x in losses):
        log("FAILED: the loss is not finite")
        return 1
    head, tail = np.mean(losses[:3]), np.mean(losses[-3:])
    log(f"loss {head:.3f} (mean of the first 3 steps) -> {tail:.3f} (mean of the last 3)")
    if tail >= head:
        log("FAILED: the loss did not fall")
        return 1
    return 0


# ----------------------------------------------------------------------------------------------------------------
# block train step: shared by check and bench


def step_flops(cfg, batch, seqlen):
    """Model FLOPs of one block train step (module docstring): 6 * P * tokens + 3 * causal attention forward."""
    attention_fwd = 4.0 * batch * seqlen * seqlen * cfg.num_heads * cfg.head_dim / 2
    return 6.0 * cfg.matmul_params() * batch * seqlen + 3.0 * attention_fwd


def block_loss(graphdef, params, x):
    """0.5 * mean(block(x)^2) in float32. The residual stream dominates its value, so the check leans on the
    gradients; its cotangent, block(x) / size, is well conditioned in bfloat16."""
    out = nnx.merge(graphdef, params)(x)
    return 0.5 * jnp.mean(jnp.square(out.astype(jnp.float32)))


def block_step(block, attention):
    """(jitted step(params, x) -> (loss, (param grads, x grad)), params) for `block` run with `attention`."""
    set_attention(block, attention)
    graphdef, params = nnx.split(block)
    step = jax.jit(jax.value_and_grad(functools.partial(block_loss, graphdef), argnums=(0, 1)))
    return step, params


def make_block(cfg, dtype, seed, abstract=False):
    build = lambda: Block(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(seed))
    return nnx.eval_shape(build) if abstract else build()


def block_input(cfg, batch, seqlen, dtype, seed):
    return jax.random.normal(jax.random.key(seed), (batch, seqlen, cfg.d_model), jnp.float32).astype(dtype)


def rel_diff(a, b):
    """||a - b|| / ||b|| over all leaves, computed in float32."""
    num = sum(jnp.sum(jnp.square(x.astype(jnp.float32) - y.astype(jnp.float32)))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    den = sum(jnp.sum(jnp.square(y.astype(jnp.float32))) for y in jax.tree.leaves(b))
    return float(jnp.sqrt(num / den))


def grad_groups(grads):
    """{name: subtree} of (param grads, x grad): the attention projections, the MLP, the norms and dx."""
    param_grads, x_grad = grads
    flat = dict(nnx.to_flat_state(param_grads))
    groups = {}
    for path, value in flat.items():
        name = ".".join(str(p) for p in path[:2] if p not in ("kernel", "scale"))
        groups.setdefault(name, []).append(value)
    groups["dx"] = [x_grad]
    return groups


def check(cfg, shape, attentions, dtype, tol, group_tol, seed):
    """Loss and gradients of each attention choice against the first of `attentions`; returns a JSON-able dict.

    Passes when the relative differences of the loss and of all gradients together are below `tol`, and that of
    each gradient group (grad_groups) below `group_tol`.
    """
    batch, seqlen = shape
    block = make_block(cfg, dtype, seed)
    x = block_input(cfg, batch, seqlen, dtype, seed + 1)
    results = {}
    for attention in attentions:
        t0 = time.perf_counter()
        step, params = block_step(block, attention)
        try:
            loss, grads = jax.block_until_ready(step(params, x))
        except Exception as e:  # an implementation that refuses the shape or runs out of memory
            results[attention] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log(f"  check {batch}x{seqlen} {attention:<9} ERROR {results[attention]}")
            continue
        results[attention] = (float(loss), grads)
        log(f"  check {batch}x{seqlen} {attention:<9} loss {float(loss):.6f}  ({time.perf_counter() - t0:.1f}s "
            "with compilation)")
    ran = [a for a in attentions if isinstance(results[a], tuple)]
    out = dict(batch=batch, seqlen=seqlen, reference=ran[0] if ran else None, tol=tol, group_tol=group_tol, rows=[],
               errors={a: r for a, r in results.items() if isinstance(r, str)})
    if not ran:
        out["passed"] = False
        return out
    ref_loss, ref_grads = results[ran[0]]
    ref_groups = grad_groups(ref_grads)
    for attention in ran[1:]:
        loss, grads = results[attention]
        groups = grad_groups(grads)
        row = dict(attention=attention, loss=loss, loss_rel=abs(loss - ref_loss) / abs(ref_loss),
                   grad_rel=rel_diff(grads, ref_grads),
                   group_rel={name: rel_diff(groups[name], ref_groups[name]) for name in ref_groups})
        row["passed"] = bool(row["loss_rel"] < tol and row["grad_rel"] < tol
                             and max(row["group_rel"].values()) < group_tol)
        out["rows"].append(row)
        worst = max(row["group_rel"], key=row["group_rel"].get)
        log(f"  check {batch}x{seqlen} {attention} vs {ran[0]}: loss rel diff {row['loss_rel']:.1e}, gradient rel "
            f"diff {row['grad_rel']:.1e} (all), {row['group_rel'][worst]:.1e} (worst: {worst}) -> "
            f"{'ok' if row['passed'] else 'FAILED'} (tolerances {tol:g}, per group {group_tol:g})")
    out["passed"] = not out["errors"] and all(r["passed"] for r in out["rows"])
    return out


# ----------------------------------------------------------------------------------------------------------------
# bench


def time_step(step, args_, warmup, iters):
    for _ in range(warmup):
        jax.block_until_ready(step(*args_))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(*args_))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_times(shape, attentions, args, block, x):
    """Times the train steps of `attentions` at `shape` in turns, in this process: each step compiled and warmed up,
    then --rounds rounds, each timing --steps steps of every attention (after one untimed step), the order rotated
    by one each round so that no attention always runs first or after the same one. Clock and thermal drift over
    the run then falls on every attention alike. Returns {attention: [median step time of each round, s]}; an
    attention whose step fails is left out (its isolated row reports the error)."""
    compiled = {}
    for attention in attentions:
        try:
            step, params = block_step(block, attention)
            step = step.lower(params, x).compile()
            for _ in range(args.warmup):
                jax.block_until_ready(step(params, x))
            compiled[attention] = step, params
        except Exception as e:
            log(f"  [{shape[0]}x{shape[1]} {attention}] left out of the interleaved rounds: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}")
    order = list(compiled)
    times = {a: [] for a in order}
    for r in range(args.rounds if order else 0):
        turn = order[r % len(order):] + order[:r % len(order)]
        for attention in turn:
            step, params = compiled[attention]
            times[attention].append(time_step(step, (params, x), 1, args.steps))
        log(f"  [{shape[0]}x{shape[1]}] round {r + 1}/{args.rounds}: " + ", ".join(
            f"{a} {times[a][-1] * 1e3:.2f} ms" for a in turn))
    return times


def apply_rounds(rows, shape, times, peak):
    """Sets the step time of `shape`'s rows to the median of their interleaved rounds (the isolated measurement's
    stays as step_ms_isolated) and recomputes tokens/s, TFLOP/s and MFU from it."""
    for row in rows:
        t = times.get(row["attention"])
        if (row["batch"], row["seqlen"]) != tuple(shape) or row.get("error") or not t:
            continue
        median = statistics.median(t)
        row.update(step_ms_isolated=row["step_ms"], step_ms_rounds=[v * 1e3 for v in t], step_ms=median * 1e3,
                   tokens_per_s=row["tokens"] / median, tflops=row["model_flops"] / median / 1e12)
        row["mfu"] = None if peak is None else row["tflops"] / peak


def mfu_peak(peak_tflops, kind, on_gpu, dtype):
    """(the peak TFLOP/s MFU is reported against, or None for no MFU; what it is or why there is none).

    `peak_tflops` (--peak-tflops) if given; else, on a GPU of GPU_PEAK_TFLOPS, its dense 16-bit peak for bfloat16
    and float16 steps."""
    if peak_tflops is not None:
        return peak_tflops, "--peak-tflops"
    if not on_gpu:
        return None, "no GPU (a smoke run)"
    if kind not in GPU_PEAK_TFLOPS:
        return None, f"the peak of {kind} is not known (--peak-tflops)"
    peak, model = GPU_PEAK_TFLOPS[kind]
    if dtype.itemsize != 2:
        return None, f"the known peak of the {model} is its bfloat16/float16 one, the step runs in {dtype.name}"
    return peak, f"the dense bfloat16/float16 peak of the {model}"


def bench_one(cfg, shape, attention, dtype, args, block, x, peak):
    """Compiles, warms up and times one (shape, attention) train step; returns a result row (MFU against `peak`
    TFLOP/s, None without one)."""
    batch, seqlen = shape
    device = jax.devices()[0]
    flops = step_flops(cfg, batch, seqlen)
    row = dict(attention=attention, batch=batch, seqlen=seqlen, tokens=batch * seqlen, step_ms=None,
               tokens_per_s=None, tflops=None, mfu=None, compile_s=None, peak_bytes=None, xla_temp_bytes=None,
               xla_total_bytes=None, model_flops=flops, error=None)
    try:
        step, params = block_step(block, attention)
        log(f"  [{batch}x{seqlen} {attention}] compiling ...")
        t0 = time.perf_counter()
        compiled = step.lower(params, x).compile()
        row["compile_s"] = time.perf_counter() - t0
        memory = compiled.memory_analysis()
        if memory is not None:
            row["xla_temp_bytes"] = memory.temp_size_in_bytes
            row["xla_total_bytes"] = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                                      + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
        log(f"  [{batch}x{seqlen} {attention}] compiled in {row['compile_s']:.1f}s; {args.warmup} warm-up + "
            f"{args.steps} timed steps ...")
        t = time_step(compiled, (params, x), args.warmup, args.steps)
        row.update(step_ms=t * 1e3, tokens_per_s=batch * seqlen / t, tflops=flops / t / 1e12)
        row["mfu"] = None if peak is None else row["tflops"] / peak
        stats = device.memory_stats() or {}
        row["peak_bytes"] = stats.get("peak_bytes_in_use")
    except Exception as e:  # an implementation that refuses the shape or runs out of memory
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def describe(row):
    if row["error"]:
        return f"ERROR {row['error']}"
    peak = "–" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**30:.1f} GiB"
    mfu = "" if row["mfu"] is None else f"MFU {100 * row['mfu']:.3g}%, "
    return (f"{row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, {row['tflops']:.3g} TFLOP/s, "
            f"{mfu}peak memory {peak}")


def dry_run(cfg, shapes, attentions, dtype, seed):
    """Lowers the block train step of every (shape, attention) from abstract shapes; executes nothing."""
    block = make_block(cfg, dtype, seed, abstract=True)
    failed = 0
    for batch, seqlen in shapes:
        x = jax.ShapeDtypeStruct((batch, seqlen, cfg.d_model), dtype)
        for attention in attentions:
            step, params = block_step(block, attention)
            t0 = time.perf_counter()
            try:
                text = step.lower(params, x).as_text()
            except Exception as e:
                failed += 1
                log(f"  lower {batch}x{seqlen} {attention:<9} ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            calls = [t for t in ("jax_flash_fwd", "jax_flash_bwd") if t in text]
            if attention == "jax_flash" and len(calls) != 2:
                failed += 1
                log(f"  lower {batch}x{seqlen} {attention:<9} ERROR: the jax_flash custom calls are missing")
                continue
            log(f"  lower {batch}x{seqlen} {attention:<9} ok ({time.perf_counter() - t0:.1f}s, {len(text) / 1e3:.0f}k "
                f"chars of StableHLO{', calls ' + ' + '.join(calls) if calls else ''}); "
                f"{step_flops(cfg, batch, seqlen) / 1e12:.1f} model TFLOP per step")
    return 1 if failed else 0


def run_child(argv, env):
    """Runs this script with `argv` in a child process, echoing its output; returns (rc, last lines)."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        print("    | " + line, end="", flush=True)
        tail = (tail + [line.rstrip()])[-5:]
    return proc.wait(), tail


def child_argv(args, mode, shape, attentions, out, name):
    argv = ["--mode", mode, "--config", args.config, "--dtype", args.dtype, "--seed", str(args.seed),
            "--batch", str(shape[0]), "--seq", str(shape[1]), "--attention", *attentions, "--out", out,
            "--name", name, "--check-tol", str(args.check_tol), "--check-group-tol", str(args.check_group_tol),
            "--child"]
    if mode == "bench":
        argv += ["--no-isolate", "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
        if args.peak_tflops is not None:
            argv += ["--peak-tflops", str(args.peak_tflops)]
    return argv


def isolated(args, shapes, env, peak):
    """Each shape's check, then each (shape, attention) measurement (compilation, peak memory), then the shape's
    interleaved rounds over all attentions (the step times), each in a child process; returns (checks, rows)."""
    checks, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        if len(args.attention) > 1:
            for i, shape in enumerate(shapes):
                log(f"check {shape[0]}x{shape[1]} (child process)")
                rc, tail = run_child(child_argv(args, "check", shape, args.attention, tmp, f"check{i}"), env)
                path = os.path.join(tmp, f"check{i}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        checks += json.load(f)["checks"]
                else:
                    checks.append(dict(batch=shape[0], seqlen=shape[1], passed=False, rows=[],
                                       errors={"child": f"exited with code {rc}: {' / '.join(tail)}"}))
        for i, shape in enumerate(shapes):
            for j, attention in enumerate(args.attention):
                log(f"bench {shape[0]}x{shape[1]} {attention} (child process)")
                rc, tail = run_child(child_argv(args, "bench", shape, [attention], tmp, f"bench{i}-{j}"), env)
                path = os.path.join(tmp, f"bench{i}-{j}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        rows += json.load(f)["rows"]
                else:
                    row = dict(attention=attention, batch=shape[0], seqlen=shape[1],
                               error=f"child exited with code {rc}: {' / '.join(tail)}")
                    rows.append(row)
            log(f"interleaved rounds {shape[0]}x{shape[1]} (child process)")
            rc, tail = run_child(child_argv(args, "bench", shape, args.attention, tmp, f"rounds{i}") + ["--rounds-child"],
                                 env)
            path = os.path.join(tmp, f"rounds{i}.json")
            if os.path.exists(path):
                with open(path) as f:
                    apply_rounds(rows, shape, json.load(f)["times"], peak)
            else:
                log(f"  interleaved rounds failed (code {rc}: {' / '.join(tail)}); the isolated times stand")
    return checks, rows


def in_process(cfg, args, shapes, dtype, peak):
    """Each shape's check, then its measurements (MFU against `peak`) and interleaved rounds, in this process;
    returns (checks, rows)."""
    checks, rows = [], []
    block = make_block(cfg, dtype, args.seed)
    for shape in shapes:
        if len(args.attention) > 1:
            log(f"check {shape[0]}x{shape[1]}")
            checks.append(check(cfg, shape, args.attention, dtype, args.check_tol, args.check_group_tol, args.seed))
        x = block_input(cfg, *shape, dtype, args.seed + 1)
        for attention in args.attention:
            row = bench_one(cfg, shape, attention, dtype, args, block, x, peak)
            rows.append(row)
            log(f"bench {shape[0]}x{shape[1]} {attention:<9} {describe(row)}")
        if not args.child:  # an isolating parent runs the rounds in a child of their own
            apply_rounds(rows, shape, interleaved_times(shape, args.attention, args, block, x), peak)
    return checks, rows


def fmt(x, spec):
    return "–" if x is None else format(x, spec)


def markdown(meta, checks, rows):
    cfg = meta["config"]
    lines = [f"# LLaMA block train step: {meta['device']}, jax {meta['jax_version']}, {meta['date']}", "",
             f"One block of `{meta['config_name']}` (d_model {cfg['d_model']}, {cfg['num_heads']} q / "
             f"{cfg['num_kv_heads']} kv heads x {cfg['head_dim']}, MLP {cfg['mlp_dim']}), {meta['dtype']} parameters "
             "and activations, causal. Step = forward + backward (gradients of the parameters and the block input) "
             f"under jax.jit. Step time: the median over {meta['rounds']} interleaved rounds of each round's median "
             f"of {meta['steps']} timed steps; a round times every attention in turn in one process (after "
             f"compilation and {meta['warmup']} warm-up steps each), the order rotated by one each round, so that "
             "the GPU's clock and thermal drift falls on all alike. The spread column gives the rounds' fastest and "
             "slowest medians.", "",
             ("Smoke run without a GPU: the timings are not performance numbers. " if meta["smoke"] else "") +
             f"Model FLOPs: {meta['flops_formula']}. " +
             (f"MFU against {meta['peak_tflops']:g} TFLOP/s, {meta['peak_note']}. " if meta["peak_tflops"] is not None
              else f"No MFU: {meta['peak_note']}. ") +
             f"Peak memory: {meta['memory_note']}", ""]
    if checks:
        lines += ["## Agreement check", "",
                  "| B x S | attention | vs | loss rel diff | grad rel diff (all) | worst group | passed |",
                  "|---|---|---|---|---|---|---|"]
        for c in checks:
            for r in c["rows"]:
                worst = max(r["group_rel"], key=r["group_rel"].get)
                lines.append(f"| {c['batch']} x {c['seqlen']} | {r['attention']} | {c['reference']} | "
                             f"{r['loss_rel']:.1e} | {r['grad_rel']:.1e} | {worst} {r['group_rel'][worst]:.1e} | "
                             f"{'yes' if r['passed'] else 'NO'} |")
            for name, error in c.get("errors", {}).items():
                lines.append(f"| {c['batch']} x {c['seqlen']} | {name} | | error: {error} | | | NO |")
        lines.append("")
    lines += ["## Throughput", "",
              "| B x S | attention | ms / step | spread (ms) | tokens/s | TFLOP/s | MFU | peak memory (GiB) | "
              "XLA plan (GiB) | tokens/s vs jax_flash |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["batch"], r["seqlen"]): r for r in rows if r["attention"] == "jax_flash" and not r.get("error")}
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['batch']} x {r['seqlen']} | {r['attention']} | error: {r['error']} | | | | | | | |")
            continue
        b = base.get((r["batch"], r["seqlen"]))
        ratio = None if b is None else r["tokens_per_s"] / b["tokens_per_s"]
        gib = lambda v: None if v is None else v / 2**30
        mfu = "–" if r["mfu"] is None else f"{100 * r['mfu']:.3g}%"
        spread = (f"{min(r['step_ms_rounds']):.2f}–{max(r['step_ms_rounds']):.2f}" if r.get("step_ms_rounds")
                  else "–")
        lines.append(f"| {r['batch']} x {r['seqlen']} | {r['attention']} | {r['step_ms']:.2f} | {spread} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tflops']:.3g} | {mfu} | "
                     f"{fmt(gib(r['peak_bytes']), '.2f')} | {fmt(gib(r['xla_total_bytes']), '.2f')} | "
                     f"{fmt(ratio, '.2f')} |")
    best = {}  # (batch, seqlen) -> the fastest peer's row
    for r in rows:
        if r["attention"] in GPU_ONLY and not r.get("error"):
            key = (r["batch"], r["seqlen"])
            if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
                best[key] = r
    if best and base:
        lines += ["", "jax_flash tokens/s / the best peer's (" + ", ".join(a for a in GPU_ONLY if a in {
            r["attention"] for r in rows}) + "): " + "; ".join(
            f"{b} x {s}: {base[(b, s)]['tokens_per_s'] / r['tokens_per_s']:.3f} ({r['attention']})"
            for (b, s), r in best.items() if (b, s) in base) + "."]
    if meta.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{a}: {why}" for a, why in meta["skipped"].items()) + "."]
    return "\n".join(lines) + "\n"


def warn_if_slow(args, on_gpu):
    if args.config == "llama3-8b" and not on_gpu and not args.dry_run and not args.child:
        log("note: a llama3-8b block takes minutes per step without a GPU; --config tiny runs the same pipeline on a "
            "tiny block, --dry-run only lowers the full-size steps")


def block_setup(args, describe):
    """The block config, dtype, device kind and shapes of a check/bench run; logs a header ending in
    describe(shapes) and warns when the run would be slow."""
    cfg = CONFIGS[args.config]
    dtype = jnp.dtype(args.dtype)
    _, kind, on_gpu = device_info()
    shapes = [(args.batch, args.seq)] if args.batch else BENCH_SHAPES[args.config]
    log(f"{kind} | jax {jax.__version__} | one {args.config} block, {dtype.name} | {describe(shapes)}")
    warn_if_slow(args, on_gpu)
    return cfg, dtype, kind, shapes


def bench(args, child_env):
    cfg, dtype, kind, shapes = block_setup(
        args, lambda shapes: f"shapes {', '.join(f'{b}x{s}' for b, s in shapes)} | attention "
                             f"{', '.join(args.attention)}")
    if args.dry_run:
        return dry_run(cfg, shapes, args.attention, dtype, args.seed)
    _, _, on_gpu = device_info()
    if args.rounds_child:  # the interleaved rounds of one shape, for an isolating parent
        times = interleaved_times(shapes[0], args.attention, args, make_block(cfg, dtype, args.seed),
                                  block_input(cfg, *shapes[0], dtype, args.seed + 1))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, args.name + ".json"), "w") as f:
            json.dump(dict(times=times), f)
        return 0
    peak, peak_note = mfu_peak(args.peak_tflops, kind, on_gpu, dtype)
    if not args.child:
        if not on_gpu:
            log(f"No GPU: a smoke run of the benchmark pipeline; its timings are not performance numbers. Results go "
                f"to {args.out}.")
        log(f"MFU against {peak:g} TFLOP/s, {peak_note}." if peak is not None else f"No MFU: {peak_note}.")
    if args.isolate:
        checks, rows = isolated(args, shapes, child_env, peak)
        memory_note = ("device.memory_stats()['peak_bytes_in_use'] of a child process that ran only that "
                       "measurement (compilation, warm-up and timing).")
    else:
        checks, rows = in_process(cfg, args, shapes, dtype, peak)
        memory_note = ("device.memory_stats()['peak_bytes_in_use'] of this process after the measurement: the peak "
                       "so far, including the agreement check and earlier measurements.")
    memory_note += " XLA plan = arguments + outputs + temporaries of the compiled step (compiled.memory_analysis())."
    date = datetime.date.today().isoformat()
    meta = dict(device=kind, platform=jax.devices()[0].platform, jax_version=jax.__version__,
                jax_flash_version=jax_flash.__version__, date=date, dtype=dtype.name, config_name=args.config,
                config=dataclasses.asdict(cfg), steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                peak_tflops=peak,
                peak_note=peak_note, smoke=not on_gpu, isolated=args.isolate, memory_note=memory_note,
                skipped=args.skipped,
                flops_formula="6 * P * B * S + 3 * (4 * B * S^2 * Hq * D / 2), P = weights in the block's matmuls "
                              f"({cfg.matmul_params():,})",
                method="median over interleaved rounds (every attention in turn, in one process, the order rotated "
                       "each round) of each round's median wall clock of the jit-compiled train step, "
                       "block_until_ready")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name or f"llama_block-{kind.replace(' ', '_')}-{date}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, checks=checks, rows=rows), f, indent=1)
    md = markdown(meta, checks, rows)
    with open(stem + ".md", "w") as f:
        f.write(md)
    if not args.child:
        log(md)
        log(f"wrote {stem}.json, {stem}.md")
    failed = any(not c["passed"] for c in checks) or any(r.get("error") for r in rows)
    return 1 if failed else 0


def check_mode(args):
    cfg, dtype, kind, shapes = block_setup(
        args, lambda shapes: f"attention {', '.join(args.attention)} | tolerances {args.check_tol:g}, per "
                             f"gradient group {args.check_group_tol:g}")
    if args.dry_run:
        return dry_run(cfg, shapes, args.attention, dtype, args.seed)
    checks = [check(cfg, shape, args.attention, dtype, args.check_tol, args.check_group_tol, args.seed)
              for shape in shapes]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, args.name or f"llama_block-check-{kind.replace(' ', '_')}")
        with open(stem + ".json", "w") as f:
            json.dump(dict(checks=checks), f, indent=1)
    passed = all(c["passed"] for c in checks)
    log("check passed" if passed else "check FAILED")
    return 0 if passed else 1


# ----------------------------------------------------------------------------------------------------------------
# multi: several devices


LHS_FLAG = "--xla_gpu_enable_latency_hiding_scheduler=true"
STRATEGIES = ("dp", "fsdp", "tp")  # block train step over n devices
CP_STRATEGIES = ("ring", "allgather", "cudnn")  # causal attention over one sequence cut into n parts


def param_specs(params, strategy, axis):
    """PartitionSpecs of the block's parameters: replicated (dp), each matrix cut along its input dimension (fsdp),
    or Megatron-style over the heads (tp: q/k/v/gate/up by output columns, o/down by input rows)."""
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")

    def spec(path, x):
        name = jax.tree_util.keystr(path)
        if x.ndim != 2 or strategy == "dp":
            return P()
        if strategy == "fsdp":
            return P(axis, None)
        return P(None, axis) if any(c in name for c in column) else P(axis, None)

    return jax.tree_util.tree_map_with_path(spec, params)


def multi_block_row(cfg, dtype, args, n, strategy, attention, block):
    """Times the block train step over the first n devices with `strategy`; returns a result row."""
    devices = jax.devices()[:n]
    axis = "dp" if strategy in ("dp", "fsdp") else "tp"
    mesh = jax.make_mesh((n,), (axis,), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
    batch = args.batch * n if axis == "dp" else args.batch  # dp/fsdp: args.batch sequences per device
    row = dict(kind="block", devices=n, strategy=strategy, impl=attention, batch=batch, seqlen=args.seq,
               tokens=batch * args.seq, step_ms=None, tokens_per_s=None, tokens_per_s_per_device=None,
               tflops_per_device=None, collectives=None, error=None)
    try:
        step, params = block_step(block, attention)
        named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
        params = jax.device_put(params, jax.tree.map(named, param_specs(params, strategy, axis)))
        x = jax.device_put(block_input(cfg, batch, args.seq, dtype, args.seed + 1),
                           named(P(axis) if axis == "dp" else P()))
        compiled = step.lower(params, x).compile()
        row["collectives"] = hlo_collectives(dump_hlo(args, compiled, f"block-{n}-{strategy}-{attention}"))
        t = time_step(compiled, (params, x), args.warmup, args.steps)
        row.update(step_ms=t * 1e3, tokens_per_s=row["tokens"] / t, tokens_per_s_per_device=row["tokens"] / t / n,
                   tflops_per_device=step_flops(cfg, batch, args.seq) / t / n / 1e12)
    except Exception as e:  # an implementation that refuses the sharding or runs out of memory
        row["error"] = error_text(e)
    return row


def error_text(e):
    """An exception in one line: its type, first line and (for a long message, such as a traceback relayed by a
    partitioner) its last line, which names the cause."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [""]
    text = lines[0][:200] + (f" ... {lines[-1][:300]}" if len(lines) > 1 else "")
    return f"{type(e).__name__}: {text}"


def dump_hlo(args, compiled, name):
    """The compiled (scheduled) HLO text; also written to --dump-hlo/<name>.hlo.txt when given."""
    text = compiled.as_text()
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
        with open(os.path.join(args.dump_hlo, name + ".hlo.txt"), "w") as f:
            f.write(text)
    return text


def hlo_collectives(text):
    """{collective: count} in compiled HLO text (an async pair counted once)."""
    names = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
    counts = {name: len(re.findall(rf" {name}(?:-start)?\(", text)) for name in names}  # opcodes, not operands
    return {k: v for k, v in counts.items() if v}


def cp_attention_row(cfg, dtype, args, n, strategy, local_seq, impl="jax_flash"):
    """Times causal attention forward + backward over one sequence of n * local_seq tokens on the first n devices:
    `ring` (jax_flash.ring_attention_sharded, zigzag), `allgather` (jax_flash.dot_product_attention under jit on
    sequence-sharded inputs: K and V gathered, Q kept sharded), `cudnn` (jax.nn.dot_product_attention on the same
    inputs), or on one device (n = 1, strategy `single`, `impl` jax_flash or cudnn)."""
    seq = n * local_seq
    impl = "cudnn" if strategy == "cudnn" else impl
    row = dict(kind="cp_attention", devices=n, strategy=strategy, impl=impl, batch=1, seqlen=seq,
               local_seqlen=local_seq, heads_q=cfg.num_heads, heads_kv=cfg.num_kv_heads, head_dim=cfg.head_dim,
               ms=None, tflops_per_device=None, collectives=None, error=None)
    devices = jax.devices()[:n]
    mesh = jax.make_mesh((n,), ("cp",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
    if strategy == "ring":
        def attend(q, k, v):
            return jax_flash.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="cp", layout="zigzag",
                                                    is_causal=True)
    elif impl == "cudnn":
        def attend(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    else:
        def attend(q, k, v):
            return jax_flash.dot_product_attention(q, k, v, is_causal=True)

    def loss(q, k, v, do):
        return jnp.sum((attend(q, k, v) * do).astype(jnp.float32))

    try:
        keys = jax.random.split(jax.random.key(args.seed), 4)
        shapes = [(1, seq, cfg.num_heads, cfg.head_dim), (1, seq, cfg.num_kv_heads, cfg.head_dim),
                  (1, seq, cfg.num_kv_heads, cfg.head_dim), (1, seq, cfg.num_heads, cfg.head_dim)]
        sharding = NamedSharding(mesh, P(None, "cp"))
        # The ring takes its inputs in zigzag order; the inputs are random, so they are drawn in that order.
        q, k, v, do = (jax.device_put(jax.random.normal(key, shape, dtype), sharding)
                       for key, shape in zip(keys, shapes))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, do).compile()
        row["collectives"] = hlo_collectives(dump_hlo(args, step, f"cp-{n}-{strategy}-{impl}"))
        t = time_step(step, (q, k, v, do), args.warmup, args.steps)
        flops = 3.5 * 4.0 * seq * seq * cfg.num_heads * cfg.head_dim / 2  # causal forward + backward (2.5 x)
        row.update(ms=t * 1e3, tflops_per_device=flops / t / n / 1e12)
    except Exception as e:
        row["error"] = error_text(e)
    return row


def multi_markdown(meta, rows):
    lines = [f"# LLaMA block and context-parallel attention on several devices: {meta['device']}, "
             f"jax {meta['jax_version']}, {meta['date']}", "",
             f"One `{meta['config_name']}` block, {meta['dtype']}, causal; median of {meta['steps']} timed steps after "
             f"{meta['warmup']} warm-up steps. Block: {args_note(meta)}. Per-device numbers divide by the devices; "
             "scaling = per-device throughput over the same implementation's on one device. "
             f"XLA_FLAGS: `{meta['xla_flags'] or '(none)'}`.", "",
             "## Block train step", "",
             "| devices | strategy | attention | B x S | ms / step | tokens/s | tokens/s per device | TFLOP/s per "
             "device | scaling | collectives |", "|---|---|---|---|---|---|---|---|---|---|"]
    one = {(r["impl"]): r for r in rows if r["kind"] == "block" and r["devices"] == 1 and not r["error"]}
    for r in (r for r in rows if r["kind"] == "block"):
        if r["error"]:
            lines.append(f"| {r['devices']} | {r['strategy']} | {r['impl']} | {r['batch']} x {r['seqlen']} | error: "
                         f"{r['error']} | | | | | |")
            continue
        base = one.get(r["impl"])
        scaling = None if base is None else r["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
        lines.append(f"| {r['devices']} | {r['strategy']} | {r['impl']} | {r['batch']} x {r['seqlen']} | "
                     f"{r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_device']:,.0f} | "
                     f"{r['tflops_per_device']:.3g} | {fmt(scaling, '.3f')} | {collective_note(r)} |")
    cp = [r for r in rows if r["kind"] == "cp_attention"]
    if cp:
        lines += ["", "## Context-parallel causal attention, forward + backward", "",
                  "One sequence, zigzag ring (`ring_attention_sharded`), all-gather of K/V (`dot_product_attention` "
                  "under jit on sequence-sharded inputs) and jax.nn cudnn on the same sharded inputs, against one "
                  "device at the same local length. TFLOP/s: causal forward + backward FLOPs of the whole sequence "
                  "(3.5 x 4 S^2 H D / 2) over the time and the devices.", "",
                  "| devices | strategy | impl | S (local) | ms | TFLOP/s per device | vs one device | collectives |",
                  "|---|---|---|---|---|---|---|---|"]
        single = {r["local_seqlen"]: r for r in cp if r["devices"] == 1 and r["impl"] == "jax_flash" and not r["error"]}
        for r in cp:
            if r["error"]:
                lines.append(f"| {r['devices']} | {r['strategy']} | {r['impl']} | {r['seqlen']} ({r['local_seqlen']}) "
                             f"| error: {r['error']} | | | |")
                continue
            base = single.get(r["local_seqlen"])
            ratio = None if base is None else r["tflops_per_device"] / base["tflops_per_device"]
            lines.append(f"| {r['devices']} | {r['strategy']} | {r['impl']} | {r['seqlen']} ({r['local_seqlen']}) | "
                         f"{r['ms']:.1f} | {r['tflops_per_device']:.3g} | {fmt(ratio, '.3f')} | {collective_note(r)} |")
    return "\n".join(lines) + "\n"


def args_note(meta):
    return (f"data parallel (dp: weights replicated, fsdp: weights sharded) with {meta['batch']} x {meta['seq']} "
            f"tokens per device; tensor parallel (tp) over the heads with {meta['batch']} x {meta['seq']} tokens in all")


def collective_note(row):
    return ", ".join(f"{k} {v}" for k, v in (row["collectives"] or {}).items()) or "none"


def multi(args):
    cfg = CONFIGS[args.config]
    dtype = jnp.dtype(args.dtype)
    _, kind, on_gpu = device_info()
    counts = args.devices or sorted({1, jax.device_count()})
    if max(counts) > jax.device_count():
        log(f"error: --devices {max(counts)} but only {jax.device_count()} devices")
        return 2
    log(f"{kind} x {jax.device_count()} | jax {jax.__version__} | one {args.config} block, {dtype.name} | devices "
        f"{counts} | strategies {', '.join(args.strategy)} | attention {', '.join(args.attention)}")
    if not on_gpu:
        log("No GPU: a smoke run of the multi-device pipeline; its timings are not performance numbers.")
    rows = []
    block = make_block(cfg, dtype, args.seed)
    for n in counts:
        for strategy in (["dp"] if n == 1 else args.strategy):
            for attention in args.attention:
                row = multi_block_row(cfg, dtype, args, n, strategy, attention, block)
                rows.append(row)
                log(f"block {n} device(s) {strategy:<5} {attention:<9} " + (
                    f"ERROR {row['error']}" if row["error"] else
                    f"{row['step_ms']:.1f} ms, {row['tokens_per_s_per_device']:,.0f} tokens/s per device, "
                    f"collectives: {collective_note(row)}"))
    local = args.cp_local_seq or (32768 if on_gpu else 64)
    for n in counts:
        strategies = ["single"] if n == 1 else args.cp_strategy
        impls = [a for a in args.attention if a in ("jax_flash", "cudnn")] if n == 1 else [None]
        for strategy in strategies:
            for impl in impls:
                row = cp_attention_row(cfg, dtype, args, n, strategy, local, impl or "jax_flash")
                rows.append(row)
                log(f"cp attention {n} device(s) {strategy:<9} {row['impl']:<9} S {row['seqlen']} " + (
                    f"ERROR {row['error']}" if row["error"] else
                    f"{row['ms']:.1f} ms, {row['tflops_per_device']:.1f} TFLOP/s per device, collectives: "
                    f"{collective_note(row)}"))
    date = datetime.date.today().isoformat()
    meta = dict(device=kind, device_count=jax.device_count(), platform=jax.devices()[0].platform,
                jax_version=jax.__version__, jax_flash_version=jax_flash.__version__, date=date, dtype=dtype.name,
                config_name=args.config, config=dataclasses.asdict(cfg), steps=args.steps, warmup=args.warmup,
                batch=args.batch, seq=args.seq, smoke=not on_gpu, xla_flags=os.environ.get("XLA_FLAGS", ""),
                method="median wall clock of the jit-compiled step, block_until_ready")
    for row in rows:
        row.update(device=kind, jax_version=jax.__version__, date=date)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name or f"llama_multi-{kind.replace(' ', '_')}-x{max(counts)}-{date}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    md = multi_markdown(meta, rows)
    with open(stem + ".md", "w") as f:
        f.write(md)
    log(md)
    log(f"wrote {stem}.json, {stem}.md")
    return 1 if any(r["error"] for r in rows) else 0


# ----------------------------------------------------------------------------------------------------------------
# command line


# ----------------------------------------------------------------------------------------------------------------
# generate: prefill, then greedy decode steps through the KV caches


def _greedy_fn(model, run):
    """jit of (state, tokens, caches) -> (the greedy next token of each sequence, caches) for `model` with its
    attention as set now, `run(model, tokens, caches)` giving (logits, caches); the caches donated so that they
    update in place."""
    graph, _ = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=2)
    def greedy(state, tokens, caches):
        logits, caches = run(nnx.merge(graph, state), tokens, caches)
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), caches
    return greedy


def prefill_fn(model):
    """The jitted prefill: (state, tokens [B, P], caches) -> (the next token of each sequence, caches)."""
    return _greedy_fn(model, lambda m, tokens, caches: m.prefill(tokens, caches))


def decode_step_fn(model):
    """The jitted greedy decode step: (state, token [B], caches) -> (the next token of each sequence, caches)."""
    return _greedy_fn(model, lambda m, token, caches: m.decode(token[:, None], caches))


def generate(args):
    """Prefills a random prompt of B x P tokens with the jax_flash kernels (the same for every choice: jax.nn's xla
    prefill would materialise B x H x P x P scores), then times N greedy decode steps (one token per sequence each,
    the caches donated so they update in place) with each attention choice on the same weights. Reports decode
    tokens/s (B x timed steps / time; the first step, which compiles, is not timed) and how many generated tokens
    agree with the first choice's."""
    cfg = CONFIGS[args.config]
    dtype = jnp.dtype(args.dtype)
    device, kind, on_gpu = device_info()
    batch, prompt, steps = args.batch, args.seq, args.steps
    max_len = prompt + steps
    model = Decoder(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    kv_bytes = cfg.num_layers * 2 * batch * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize  # per cached token
    log(f"{kind} | jax {jax.__version__} | {args.config}: {cfg.num_layers} layers, {n_params / 1e6:,.1f}M params "
        f"({dtype.name}) | batch {batch}, prompt {prompt}, {steps} tokens ({steps - 1} decode steps) | KV cache "
        f"{kv_bytes * max_len / 2**30:.2f} GiB")
    tokens = jax.random.randint(jax.random.key(args.seed + 1), (batch, prompt), 0, cfg.vocab, jnp.int32)
    set_attention(model, "jax_flash")
    _, state = nnx.split(model)
    prefill = prefill_fn(model)

    rows, generated = [], {}
    for attention in args.attention:
        set_attention(model, attention)
        step = decode_step_fn(model)
        caches = model.init_caches(batch, max_len, equal_lengths=args.cache_lengths == "equal")
        t0 = time.perf_counter()
        token, caches = prefill(state, tokens, caches)
        token.block_until_ready()
        prefill_s = time.perf_counter() - t0
        out = [token]
        token, caches = step(state, token, caches)  # compiles
        out.append(token)
        token.block_until_ready()
        t0 = time.perf_counter()
        for _ in range(steps - 2):
            token, caches = step(state, token, caches)
            out.append(token)
        token.block_until_ready()
        dt = time.perf_counter() - t0
        timed = steps - 2
        generated[attention] = np.asarray(jnp.stack(out, 1))
        row = dict(attention=attention, batch=batch, prompt=prompt, steps=steps, prefill_s=round(prefill_s, 3),
                   step_ms=round(dt / max(timed, 1) * 1e3, 3), tokens_per_s=round(batch * timed / dt, 1) if timed else None)
        first = generated[args.attention[0]]
        row["agree"] = round(float((generated[attention] == first).mean()), 4)
        rows.append(row)
        log(f"{attention:9s} decode {row['step_ms']:8.2f} ms/step, {row['tokens_per_s']:10,.0f} tokens/s "
            f"(prefill {prefill_s:.2f} s, the first includes compilation; tokens agreeing with {args.attention[0]}: {row['agree']:.1%})")
        del caches
    meta = dict(device=kind, platform=jax.devices()[0].platform, jax_version=jax.__version__,
                jax_flash_version=jax_flash.__version__, date=datetime.date.today().isoformat(),
                config=args.config, dtype=dtype.name, params=int(n_params), smoke=not on_gpu,
                cache_lengths=args.cache_lengths)
    best = max(rows, key=lambda r: r["tokens_per_s"] or 0)
    lines = [f"# LLaMA generation: {kind}, jax {meta['jax_version']}, {meta['date']}", "",
             ("Smoke run without a GPU: the timings are not performance numbers. " if not on_gpu else "") +
             f"{args.config} ({cfg.num_layers} layers, {n_params / 1e6:,.1f}M params, {dtype.name}), batch {batch}, "
             f"prompt {prompt} tokens (prefilled with jax_flash), {steps} tokens generated per sequence greedily "
             f"(the prefill's, then {steps - 1} decode steps of one token); the attention choice applies to the "
             f"decode steps; tokens/s over the {steps - 2} steps after the first (which compiles); KV caches with "
             f"{'one length for the batch' if args.cache_lengths == 'equal' else 'a length per sequence'} "
             f"(--cache-lengths {args.cache_lengths}).",
             "", "| attention | ms / step | tokens/s | vs best | tokens agreeing with " + args.attention[0] + " |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attention']} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / best['tokens_per_s']:.3f} | {r['agree']:.1%} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name or f"generate-{kind.replace(' ', '_')}-{meta['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text)
    log(text)
    log(f"wrote {stem}.json, {stem}.md")
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="default: bench when the default device is a GPU, train otherwise")
    parser.add_argument("--attention", nargs="+", choices=tuple(ATTENTION), default=None,
                        help="train: one choice (default jax_flash); check/bench: those to compare (default all, "
                             "without cudnn when there is no GPU)")
    parser.add_argument("--config", choices=tuple(CONFIGS), default=None,
                        help="model shape: train takes tiny (default); check/bench default to llama3-8b, "
                             "generate/multi to llama3-8b on a GPU and tiny otherwise")
    parser.add_argument("--steps", type=int, default=None,
                        help="train: steps (default 30, at least 6); bench and multi: timed steps (default 10); "
                             "generate: tokens generated a sequence, the first by the prefill, then --steps - 1 "
                             "decode steps (default 64 on a GPU, 6 otherwise; at least 3)")
    parser.add_argument("--batch", type=int, default=None, help="train default 4; check/bench: with --seq, the one "
                                                                "shape to run (default 2x4096 and 1x8192); generate: "
                                                                "prompts (16 on a GPU, 2 otherwise); multi: 2")
    parser.add_argument("--seq", type=int, default=None, help="train default 128; check/bench: see --batch; generate: "
                                                              "prompt length (4096 on a GPU, 16 otherwise); multi: "
                                                              "4096 (llama3-8b) or 64")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="activations (and, for check/bench/generate, parameters; train keeps float32 "
                             "parameters)")
    parser.add_argument("--out", default=None,
                        help=f"bench: results directory (default: benchmarks/results/ on a GPU; without one, for a "
                             f"smoke run, {SMOKE_OUT}, outside the source tree); generate and multi write there too; check: "
                             f"also write the results as JSON there")
    parser.add_argument("--name", default=None,
                        help="file stem (default: bench llama_block-<device>-<date>, check llama_block-check-<device>, "
                             "generate generate-<device>-<date>, multi llama_multi-<device>-x<devices>-<date>)")
    parser.add_argument("--lr", type=float, default=None, help="train: Adam learning rate (default 3e-3)")
    parser.add_argument("--packed", type=int, default=1,
                        help="train: documents packed into each row (segment ids keep attention within each; "
                             "positions restart per document); 1 = one sequence per row")
    parser.add_argument("--cache-lengths", choices=("equal", "per-sequence"), default=None,
                        help="generate: the KV caches' lengths (default equal): one for the batch (its prompts are of "
                             "one length: init_cache(equal_lengths=True)) or one per sequence, as a batch of padded "
                             "prompts keeps them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=None, help="bench, multi: untimed steps after compilation (default 3)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="bench: interleaved timing rounds (default 5 on a GPU, 1 otherwise): each times "
                             "--steps steps of every attention in turn, in one process")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="bench: the device's dense peak for MFU (default: on a known GPU ("
                             f"{', '.join(sorted({m for _, m in GPU_PEAK_TFLOPS.values()}))}) its dense "
                             "bfloat16/float16 peak, for bfloat16 and float16 steps; no MFU otherwise)")
    parser.add_argument("--check-tol", type=float, default=None,
                        help="check/bench: largest relative difference of the loss, and of all gradients together "
                             "(default 2e-2)")
    parser.add_argument("--check-group-tol", type=float, default=None,
                        help="check/bench: largest relative difference of each gradient group (the q, k, v, o "
                             "projections, the MLP matrices, the norms, the input; default 5e-2)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                        help="bench: run each check and measurement in a child process (default) for per-"
                             "measurement peak memory")
    parser.add_argument("--dry-run", action="store_true",
                        help="check/bench: lower every train step at full size from abstract shapes, run nothing")
    parser.add_argument("--devices", type=int, nargs="+", default=None,
                        help="multi: device counts to run (default 1 and all); the first n devices are used")
    parser.add_argument("--strategy", nargs="+", choices=STRATEGIES, default=None,
                        help="multi: block strategies on more than one device (default all): dp (weights "
                             "replicated), fsdp (weights sharded), tp (heads, Megatron-style)")
    parser.add_argument("--cp-strategy", nargs="+", choices=CP_STRATEGIES, default=None,
                        help="multi: context-parallel attention strategies on more than one device (default all)")
    parser.add_argument("--cp-local-seq", type=int, default=None,
                        help="multi: tokens per device of the context-parallel attention (default 32768 on a GPU, "
                             "64 otherwise); the sequence is n times that")
    parser.add_argument("--latency-hiding", action=argparse.BooleanOptionalAction, default=True,
                        help="multi: run with XLA's latency-hiding scheduler (XLA_FLAGS="
                             f"{LHS_FLAG}; off by default in XLA), which overlaps collectives with compute (the "
                             "gradients' all-reduce with the backward)")
    parser.add_argument("--dump-hlo", default=None, help="multi: write each compiled step's HLO text to this directory")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # set by an isolating bench run
    parser.add_argument("--rounds-child", action="store_true", help=argparse.SUPPRESS)  # its interleaved rounds
    args = parser.parse_args(argv)

    def error(message):
        parser.error(message)

    for name in ("steps", "batch", "seq", "warmup", "cp_local_seq", "rounds"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'warmup' else 'positive'}, got {value}")
    for name in ("check_tol", "check_group_tol", "peak_tflops", "lr"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args, error


def finish_args(args, error, on_gpu):
    """Fills the defaults that depend on the mode and the platform; rejects arguments the mode does not take."""
    args.mode = args.mode or ("bench" if on_gpu else "train")
    if args.mode == "train":
        args.config = args.config or "tiny"
        if args.config != "tiny":
            error("--mode train runs the tiny config only")
        args.attention = choose_attentions(args, error, on_gpu, tuple(ATTENTION)) if args.attention else ["jax_flash"]
        if len(args.attention) != 1:
            error("--mode train takes one --attention")
        args.steps = args.steps or 30
        if args.steps < 6:
            error(f"--mode train needs --steps >= 6 (it compares the mean loss of the first and last three steps), "
                  f"got {args.steps}")
        args.batch, args.seq = args.batch or 4, args.seq or 128
        for name in ("dry_run", "out", "name"):
            if getattr(args, name):
                error(f"--{name.replace('_', '-')} does not apply to --mode train")
        if not 1 <= args.packed <= args.seq:
            error(f"--packed must be between 1 and --seq ({args.seq}), got {args.packed}")
        if args.packed > 1 and args.attention != ["jax_flash"]:
            error(f"--packed (segment ids) needs --attention jax_flash ({args.attention[0]} takes no segment ids)")
    elif args.mode == "generate":
        args.config = args.config or ("llama3-8b" if on_gpu else "tiny")
        args.attention = choose_attentions(args, error, on_gpu, ("jax_flash", "cudnn", "xla"))
        args.batch = args.batch or (16 if on_gpu else 2)
        args.seq = args.seq or (4096 if on_gpu else 16)
        args.steps = args.steps or (64 if on_gpu else 6)
        if args.steps < 3:
            error("--mode generate needs --steps >= 3 (the first step compiles and is not timed)")
        args.out = args.out or (RESULTS_DIR if on_gpu else SMOKE_OUT)
        if args.dry_run:
            error("--dry-run does not apply to --mode generate")
    elif args.mode == "multi":
        args.config = args.config or ("llama3-8b" if on_gpu else "tiny")
        args.attention = (choose_attentions(args, error, on_gpu, tuple(ATTENTION)) if args.attention
                          else ["jax_flash", "cudnn"] if on_gpu else ["jax_flash", "xla"])
        if args.batch is None:
            args.batch, args.seq = 2, args.seq or (4096 if args.config == "llama3-8b" else 64)
        args.seq = args.seq or (4096 if args.config == "llama3-8b" else 64)
        args.steps = args.steps or 10
        args.out = args.out or (RESULTS_DIR if on_gpu else SMOKE_OUT)
        if args.dry_run:
            error("--dry-run does not apply to --mode multi")
    else:
        args.config = args.config or "llama3-8b"
        args.attention = choose_attentions(args, error, on_gpu, tuple(ATTENTION))
        if (args.batch is None) != (args.seq is None):
            error(f"--mode {args.mode} takes --batch and --seq together (or neither, for the default shapes)")
        if args.mode == "check" and args.steps is not None:
            error("--steps does not apply to --mode check")
        if args.mode == "check" and len(args.attention) < 2:
            error(f"--mode check compares two or more --attention choices, got {' '.join(args.attention)}")
        args.steps = args.steps or 10
        if args.mode == "bench":
            args.out = args.out or (RESULTS_DIR if on_gpu else SMOKE_OUT)
            args.rounds = args.rounds or (5 if on_gpu else 1)
    if args.mode != "bench" and args.rounds is not None:
        error("--rounds applies to --mode bench only")
    if args.mode not in ("bench", "multi") and args.warmup is not None:
        error("--warmup applies to --mode bench / multi only")
    args.warmup = 3 if args.warmup is None else args.warmup
    if args.mode != "train" and args.packed != 1:
        error("--packed applies to --mode train only")
    if args.mode != "multi":
        for name in ("devices", "strategy", "cp_strategy", "cp_local_seq", "dump_hlo"):
            if getattr(args, name) is not None:
                error(f"--{name.replace('_', '-')} applies to --mode multi only")
    else:
        args.strategy = args.strategy or list(STRATEGIES)
        args.cp_strategy = args.cp_strategy or [c for c in CP_STRATEGIES if on_gpu or c != "cudnn"]
        if args.devices is not None and min(args.devices) < 1:
            error("--devices must be positive")
    if args.mode != "bench" and not args.isolate:
        error("--no-isolate applies to --mode bench only")
    for name, modes in (("lr", ("train",)), ("cache_lengths", ("generate",)), ("peak_tflops", ("bench",)),
                        ("check_tol", ("check", "bench")), ("check_group_tol", ("check", "bench"))):
        if getattr(args, name) is not None and args.mode not in modes:
            error(f"--{name.replace('_', '-')} applies to --mode {' / '.join(modes)} only")
    if args.mode != "multi" and not args.latency_hiding:
        error("--no-latency-hiding applies to --mode multi only")
    args.lr = args.lr or 3e-3
    args.cache_lengths = args.cache_lengths or "equal"
    args.check_tol = args.check_tol or 2e-2
    args.check_group_tol = args.check_group_tol or 5e-2
    if args.out is not None and not args.dry_run:  # before any measurement, not after
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            error(f"--out {args.out}: cannot create the results directory ({e.strerror or e})")


def main(argv=None):
    args, error = parse_args(argv)
    if args.mode == "multi" and args.latency_hiding and LHS_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + LHS_FLAG).strip()  # before JAX starts
    child_env = dict(os.environ)
    if args.mode in (None, "bench") and args.isolate and not args.dry_run:
        # An orchestrating bench process only looks up the device: it must not preallocate the accelerator memory
        # that its child processes need. The children get the environment as it was.
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    _, _, on_gpu = device_info()
    finish_args(args, error, on_gpu)
    if args.mode == "train":
        return train(args)
    if args.mode == "check":
        return check_mode(args)
    if args.mode == "multi":
        return multi(args)
    if args.mode == "generate":
        return generate(args)
    return bench(args, child_env)


if __name__ == "__main__":
    sys.exit(main())
