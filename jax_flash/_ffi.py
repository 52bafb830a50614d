"""Registration of the compiled FFI targets and thin wrappers that call them.

Two nanobind extensions carry the handlers: ``_jax_flash_cpu`` (always built) and ``_jax_flash_cuda`` (absent
from a CPU-only build). Each exposes ``registrations()``, a dict {target name: capsule} for the targets
``jax_flash_fwd`` and ``jax_flash_bwd``, and the CUDA one also ``jax_flash_decode``.

Array arguments have layout [..., seq, heads, head_dim]; the handlers fold every leading dimension into one batch
dimension, so ``vmap_method="broadcast_all"`` (which prepends the mapped axis to every argument, the int32 length
arrays included) batches the calls without a loop.
"""

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

try:
    from jax_flash import _jax_flash_cpu
except ImportError:
    if importlib.util.find_spec("jax_flash._jax_flash_cpu") is not None:
        raise  # the extension is there but does not load
    raise ImportError(
        f"jax_flash's compiled extension _jax_flash_cpu is missing from {os.path.dirname(__file__)}. Usually this "
        "is the source tree, which holds no build, shadowing the installed package (Python was started in the "
        "repository root, or has it on sys.path). Install the package with `pip install .` in the repository and "
        "import it from another directory; to run the tests from the repository root, use the `pytest` command "
        "(`python -m pytest` puts the current directory on sys.path).") from None

FWD_TARGET = "jax_flash_fwd"
BWD_TARGET = "jax_flash_bwd"
DECODE_TARGET = "jax_flash_decode"  # CUDA only

for _name, _capsule in _jax_flash_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

#: Why the CUDA targets are unavailable ("" when they are registered).
CUDA_UNAVAILABLE_REASON = ""

try:
    _jax_flash_cuda = importlib.import_module("jax_flash._jax_flash_cuda")
except ImportError as e:
    _jax_flash_cuda = None
    if isinstance(e, ModuleNotFoundError) and e.name == "jax_flash._jax_flash_cuda":
        CUDA_UNAVAILABLE_REASON = "the CUDA kernels are not built (CPU-only install)"
    else:
        CUDA_UNAVAILABLE_REASON = f"the CUDA kernels failed to load: {e}"
else:
    try:
        for _name, _capsule in _jax_flash_cuda.registrations().items():
            jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
    except Exception as e:  # a jaxlib without CUDA support may refuse the platform
        CUDA_UNAVAILABLE_REASON = f"registering the CUDA kernels with JAX failed: {e}"

#: True when the CUDA targets are registered with JAX (whether or not a GPU is visible).
CUDA_REGISTERED = not CUDA_UNAVAILABLE_REASON


@functools.cache
def cuda_device_count():
    """Number of CUDA devices the CUDA runtime sees; 0 when the CUDA targets are unavailable."""
    return _jax_flash_cuda.device_count() if CUDA_REGISTERED else 0


#: CUDA kernel families a call can be forced to (KernelChoice in cuda/flash_params.h); "auto" picks by device.
KERNELS = {"auto": 0, "sm80": 1, "sm80-small-smem": 2}
_forced_kernel = contextvars.ContextVar("jax_flash_forced_kernel", default=None)


@contextlib.contextmanager
def force_kernel(kernel):
    """Runs the jax_flash calls traced inside the ``with`` block on one CUDA kernel family.

    ``kernel``: ``"auto"`` (the sm_90a kernels on compute capability 9.0, the sm_80-class ones elsewhere),
    ``"sm80"`` (the sm_80-class kernels on any GPU) or ``"sm80-small-smem"`` (also their backward as on a device
    with 99 KB of shared memory a block). For tests and comparisons of both paths in one process. The choice is
    made when a call is traced: a function that ``jax.jit`` already compiled keeps the kernels it was traced with.
    The CPU has one kernel and ignores it. Without this context the environment variable ``JAX_FLASH_FORCE_SM80``
    decides, read at each trace: unset or ``0`` for ``"auto"``, ``small-smem`` for ``"sm80-small-smem"``, anything
    else for ``"sm80"``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    token = _forced_kernel.set(kernel)
    try:
        yield
    finally:
        _forced_kernel.reset(token)


def _kernel_choice():
    """The KernelChoice attribute for a call traced now (see force_kernel)."""
    kernel = _forced_kernel.get()
    if kernel is None:
        env = os.environ.get("JAX_FLASH_FORCE_SM80", "")
        kernel = "auto" if env in ("", "0") else "sm80-small-smem" if env == "small-smem" else "sm80"
    return np.int32(KERNELS[kernel])


def _attrs(scale, is_causal, window_left, window_right, softcap, has_segments):
    return dict(
        scale=np.float32(scale),
        is_causal=bool(is_causal),
        window_left=np.int64(window_left),
        window_right=np.int64(window_right),
        softcap=np.float32(0.0 if softcap is None else softcap),
        has_segments=bool(has_segments),
        kernel=_kernel_choice(),
    )


#: Positions per chunk of the segment metadata (kSegmentChunk in cuda/mask.h).
SEGMENT_CHUNK = 16
_INT32_MAX = np.iinfo(np.int32).max


def _chunk_id_ranges(ids):
    """ids int32 [..., S] -> (min, max) int32 [..., ceil(S / 16)] over each chunk of 16 positions."""
    length = ids.shape[-1]
    pad = -length % SEGMENT_CHUNK
    shape = (*ids.shape[:-1], (length + pad) // SEGMENT_CHUNK, SEGMENT_CHUNK)
    widths = [(0, 0)] * (ids.ndim - 1) + [(0, pad)]
    lo = jnp.pad(ids, widths, constant_values=_INT32_MAX).reshape(shape)
    hi = jnp.pad(ids, widths, constant_values=-_INT32_MAX - 1).reshape(shape)
    return lo.min(-1), hi.max(-1)


def segment_metadata(q_segment_ids, kv_segment_ids):
    """The kernels' per-chunk metadata of segment ids (SegmentPolicy in cuda/mask.h).

    q_segment_ids int32 [..., T], kv_segment_ids int32 [..., S] -> (q_meta [..., ceil(T / 16), 4], kv_meta
    [..., ceil(S / 16), 4]), int32. For query chunk c (rows [16 c, 16 c + 16)): the smallest and largest id of its
    rows, then [first, end): the hull of the keys whose 16-key chunks have an id range meeting chunk c's
    ([INT32_MAX, 0) when none does); kv_meta likewise with the roles swapped. The kernels skip key (query) tiles
    outside these ranges, so a packed batch costs about its visible area whatever the number of segments, and
    treat a tile whose ids are all one value as unmasked. Cost: one pass over the (T / 16) x (S / 16) chunk pairs.
    """
    q_min, q_max = _chunk_id_ranges(q_segment_ids)
    k_min, k_max = _chunk_id_ranges(kv_segment_ids)
    meet = (q_min[..., :, None] <= k_max[..., None, :]) & (k_min[..., None, :] <= q_max[..., :, None])

    def hull(meet, length):  # meet [..., A, B] -> [first, end) positions along B for each A
        idx = jnp.arange(meet.shape[-1], dtype=jnp.int32)
        first = jnp.min(jnp.where(meet, idx, _INT32_MAX), axis=-1)
        last = jnp.max(jnp.where(meet, idx, -1), axis=-1)
        found = last >= 0
        return (jnp.where(found, first * SEGMENT_CHUNK, _INT32_MAX).astype(jnp.int32),
                jnp.where(found, jnp.minimum((last + 1) * SEGMENT_CHUNK, length), 0).astype(jnp.int32))

    key_first, key_end = hull(meet, kv_segment_ids.shape[-1])
    row_first, row_end = hull(jnp.swapaxes(meet, -1, -2), q_segment_ids.shape[-1])
    return (jnp.stack([q_min, q_max, key_first, key_end], axis=-1),
            jnp.stack([k_min, k_max, row_first, row_end], axis=-1))


def _barrier(x):
    """x materialised: XLA neither fuses its producers into its consumers nor the reverse (a cumulative reduction
    fused with what feeds it ran as a quadratic window on the GPU)."""
    return jax.lax.optimization_barrier(x)


def _id_groups(q_ids, kv_ids):
    """Per position of q_ids [N, T] and kv_ids [N, S]: the first and last position of its id on the other side and
    how many positions hold it there ((first, last, count) = (INT32_MAX, -1, 0) when none), as (q_stats, kv_stats),
    each a tuple of three [N, T] / [N, S] arrays. One stable sort of both sides' ids per batch element groups equal
    ids; each group's bounds and counts are segment reductions, gathered back to the group's positions. (Binary
    searches into the sorted ids instead cost ~1.4 ms at 4 x 8192 on an H200: XLA fused their dependent gathers.)"""
    n, t = q_ids.shape
    s = kv_ids.shape[-1]
    width = s + t
    keys = jnp.concatenate([kv_ids, q_ids], axis=-1)  # [N, S + T]: kv positions, then q positions
    order = jnp.argsort(keys, axis=-1, stable=True).astype(jnp.int32)
    sorted_keys = jnp.take_along_axis(keys, order, axis=-1)
    starts = jnp.concatenate([jnp.ones((n, 1), bool), sorted_keys[:, 1:] != sorted_keys[:, :-1]], axis=-1)
    group = (_barrier(jnp.cumsum(_barrier(starts.astype(jnp.int32)), axis=-1)) - 1
             + jnp.arange(n, dtype=jnp.int32)[:, None] * width)
    group = group.reshape(-1)
    is_kv = order < s
    pos = jnp.where(is_kv, order, order - s).reshape(-1)  # position on its own side
    is_kv = is_kv.reshape(-1)
    groups = n * width

    def side_stats(on_side):  # per group: first, last position and count of the group's positions on that side
        first = jax.ops.segment_min(jnp.where(on_side, pos, _INT32_MAX), group, groups, indices_are_sorted=True)
        last = jax.ops.segment_max(jnp.where(on_side, pos, -1), group, groups, indices_are_sorted=True)
        count = jax.ops.segment_sum(on_side.astype(jnp.int32), group, groups, indices_are_sorted=True)
        return first[group], last[group], count[group]  # back to the sorted positions

    kv_side, q_side = side_stats(is_kv), side_stats(~is_kv)
    rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, width)).reshape(-1)
    flat_order = order.reshape(-1)

    def unsort(x):  # sorted positions -> [N, S + T] in the concatenated order
        return jnp.zeros((n, width), jnp.int32).at[rows, flat_order].set(x, unique_indices=True)

    # q positions take the kv side's stats of their group, kv positions the q side's.
    q_stats = tuple(unsort(x)[:, s:] for x in kv_side)
    kv_stats = tuple(unsort(x)[:, :s] for x in q_side)
    return q_stats, kv_stats


def _runs_from_stats(first, last, count):
    """[first, last + 1) per position from _id_groups' stats, and whether those positions are contiguous. An id the
    other side lacks gets an empty interval [x, x) at x = the largest end before it (0 at the start), so the bounds
    can still rise along the positions (a part of a sequence whose ids reach into the other side's neighbouring
    parts: sharding, ring attention, prefill chunks)."""
    found = count > 0
    hi = jnp.where(found, last + 1, 0)
    # The running max between optimization barriers: fused with its producers, XLA ran the cumulative max's
    # reduce-window (and an associative_scan's slices) per element, ~1-2 ms at 4 x 8192 on an H200.
    running = _barrier(jax.lax.cummax(_barrier(hi), axis=hi.ndim - 1))
    hi = jnp.where(found, hi, running)
    lo = jnp.where(found, first, hi)
    return lo, hi, ~found | (hi - lo == count)


def segment_runs(q_segment_ids, kv_segment_ids):
    """Segment ids as runs, for the kernels' RunPolicy (cuda/mask.h).

    q_segment_ids int32 [..., T], kv_segment_ids int32 [..., S] -> (q_runs [..., T, 2], kv_runs [..., S, 2]),
    int32. q_runs[..., i, :] = [first, last + 1): the key positions holding row i's id; kv_runs likewise the rows
    holding key j's id (an id the other side lacks: an empty interval, see _runs_from_stats). A batch element whose ids
    are runs (every id in one contiguous run of positions on each side, and the bounds never decreasing along the
    positions, as packed documents are, whole or in parts) sees exactly these intervals, and the kernels take it as
    an interval mask: no per-tile id tests.
    Any other batch element is marked with q_runs[..., 0, 0] = -1 and takes the ids (segment_metadata). Cost: one
    sort of both sides' ids per batch element and a few segment reductions and scatters (_id_groups).
    """
    lead = q_segment_ids.shape[:-1]
    q_ids = q_segment_ids.reshape(-1, q_segment_ids.shape[-1])
    kv_ids = kv_segment_ids.reshape(-1, kv_segment_ids.shape[-1])
    q_stats, kv_stats = _id_groups(q_ids, kv_ids)
    q_lo, q_hi, q_ok = _runs_from_stats(*q_stats)
    kv_lo, kv_hi, kv_ok = _runs_from_stats(*kv_stats)

    def rising(x):
        return jnp.all(x[:, 1:] >= x[:, :-1], axis=-1)

    exact = (jnp.all(q_ok, axis=-1) & jnp.all(kv_ok, axis=-1) & rising(q_lo) & rising(q_hi) & rising(kv_lo)
             & rising(kv_hi))
    q_lo = q_lo.at[:, 0].set(jnp.where(_barrier(exact), q_lo[:, 0], -1))
    # (materialised before the interleave: its concatenate fusion otherwise took in the row-wide checks above and
    # recomputed them per element, ~0.5 ms at 4 x 8192 on an H200)
    q_lo, q_hi, kv_lo, kv_hi = _barrier((q_lo, q_hi, kv_lo, kv_hi))
    return (jnp.stack([q_lo, q_hi], axis=-1).reshape(*lead, -1, 2),
            jnp.stack([kv_lo, kv_hi], axis=-1).reshape(*lead, -1, 2))


def _placeholder(lead, dtype):
    """A one-element-per-batch-element stand-in of shape (*lead, 1) for an absent optional operand (never read;
    zero-size operands crash XLA:CPU inside an eager shard_map). A numpy array, so that it enters the program as a
    constant rather than as a kernel that fills it on every call."""
    return np.zeros((*lead, 1), dtype)


def _segment_operands(q, k, q_segment_ids, kv_segment_ids):
    """(q ids, kv ids, q meta, kv meta, q runs, kv runs) for the targets: placeholders when there are none."""
    if q_segment_ids is None:
        return (_placeholder(q.shape[:-3], np.int32),) * 6
    lead = q.shape[:-3]
    q_ids = jnp.broadcast_to(q_segment_ids.astype(jnp.int32), (*lead, q.shape[-3]))
    kv_ids = jnp.broadcast_to(kv_segment_ids.astype(jnp.int32), (*lead, k.shape[-3]))
    return (q_ids, kv_ids, *segment_metadata(q_ids, kv_ids), *segment_runs(q_ids, kv_ids))


def _row_stats_shape(q_shape):
    """[..., Sq, Hq, D] -> [..., Hq, Sq]."""
    return (*q_shape[:-3], q_shape[-2], q_shape[-3])


# The backward's row statistics are padded to whole tiles of this many query rows (kRowStatsAlign in
# cuda/flash_params.h; the handler checks the shape).
ROW_STATS_ALIGN = 128


def _row_stats_workspace_shape(q_shape):
    """[..., Sq, Hq, D] -> [..., Hq, 2, Sq rounded up to ROW_STATS_ALIGN]: lse * log2(e) and rowsum(do * o)."""
    rows = -(-q_shape[-3] // ROW_STATS_ALIGN) * ROW_STATS_ALIGN
    return (*q_shape[:-3], q_shape[-2], 2, rows)


def _dq_accum_workspace_shape(q_shape):
    """[..., Sq, Hq, D] -> [..., Hq, Sq rounded up to ROW_STATS_ALIGN, D rounded up to its kernel class]."""
    *lead, heads, _, rows = _row_stats_workspace_shape(q_shape)
    head_dim = q_shape[-1]
    return (*lead, heads, rows, 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256)


def _zero_offsets(offsets, lens):
    return np.zeros(lens.shape, np.int32) if offsets is None else offsets  # a constant, as _placeholder


def _vma(x):
    """The manual mesh axes x varies over inside shard_map (jax >= 0.11: aval.mat.varying; before: aval.vma)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def _varying_like(outputs, inputs):
    """Marks the outputs as varying over the manual mesh axes the inputs vary over (inside ``jax.shard_map`` with
    check_vma: an FFI call's results carry no such type, and ``platform_dependent`` needs its branches to agree)."""
    vma = frozenset().union(*(_vma(x) for x in inputs))
    if not vma:
        return outputs
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        cast = lambda x, axes: pcast(x, axes, to="varying")  # noqa: E731
    else:  # jax < 0.7.1
        cast = lambda x, axes: jax.lax.pvary(x, axes)  # noqa: E731
    return tuple(cast(x, tuple(sorted(vma - _vma(x)))) if vma - _vma(x) else x for x in outputs)


def flash_fwd(q, k, v, q_lens, kv_lens, q_offsets=None, kv_offsets=None, q_segment_ids=None, kv_segment_ids=None,
              sinks=None, *, scale, is_causal, window_left, window_right, softcap=None):
    """Runs the forward target.

    Args:
      q: [..., Sq, Hq, D]; k, v: [..., Sk, Hkv, D], all of one dtype (bfloat16, float16; float32 on CPU).
      q_lens, kv_lens: int32 [...] (the leading dims of q): valid query rows / keys per batch element, counted in
        global positions.
      q_offsets, kv_offsets: int32 [...]: the global positions of local query row 0 and key 0 when q or k/v hold a
        part of a longer sequence (sharding, ring attention); None for 0. Causal and window masks and the lengths
        apply to global positions.
      scale: logit scale. is_causal: top-left aligned causal mask.
      window_left, window_right: local window bounds, -1 for unbounded.
      q_segment_ids, kv_segment_ids: int32 [..., Sq] and [..., Sk] (both or neither): row i sees key j only if
        their ids are equal.
      sinks: float32 [..., Hq] (one logit per batch element and query head; broadcast from [Hq]) or None.
      softcap: the logit soft cap c > 0 (logits c * tanh(scale * q.k / c)) or None.

    Returns:
      (o, lse): o like q; lse float32 [..., Hq, Sq], the natural-log sum-exp of the scaled logits (and the sink),
      +inf for rows that see no key.
    """
    call = jax.ffi.ffi_call(
        FWD_TARGET,
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(_row_stats_shape(q.shape), jnp.float32),
        ),
        vmap_method="broadcast_all",
    )
    has_sinks = sinks is not None
    sinks = (_placeholder(q.shape[:-3], np.float32) if sinks is None
             else jnp.broadcast_to(sinks.astype(jnp.float32), (*q.shape[:-3], q.shape[-2])))
    inputs = (q, k, v, q_lens, kv_lens, _zero_offsets(q_offsets, q_lens), _zero_offsets(kv_offsets, kv_lens),
              *_segment_operands(q, k, q_segment_ids, kv_segment_ids), sinks)
    attrs = _attrs(scale, is_causal, window_left, window_right, softcap, q_segment_ids is not None)
    return _varying_like(call(*inputs, has_sinks=has_sinks, **attrs), inputs)


def flash_bwd(q, k, v, o, lse, do, q_lens, kv_lens, q_offsets=None, kv_offsets=None, q_segment_ids=None,
              kv_segment_ids=None, *, scale, is_causal, window_left, window_right, softcap=None,
              deterministic=False):
    """Runs the backward target: (dq, dk, dv) like (q, k, v), given the forward's o and lse and the cotangent do.

    The attributes and offsets must match the forward call's; o and lse may be those of the whole attention over a
    longer key sequence of which k, v are a part (ring attention: the backward of one part uses the global O and
    log-sum-exp). With sinks, o and lse are the sink-inclusive ones (the sinks need no operand here); segment ids
    and the soft cap as for flash_fwd. ``deterministic``: bitwise-reproducible dQ (the CPU backward
    always is; on CUDA only the sm_90a backward implements it and the handler refuses the call otherwise).
    """
    call = jax.ffi.ffi_call(
        BWD_TARGET,
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(_dq_accum_workspace_shape(q.shape), jnp.float32),  # dq accumulator (workspace)
            jax.ShapeDtypeStruct(_row_stats_workspace_shape(q.shape), jnp.float32),  # lse, rowsum(do * o) (workspace)
            jax.ShapeDtypeStruct(_row_stats_shape(q.shape), jnp.int32),  # dQ tile semaphores (workspace)
        ),
        vmap_method="broadcast_all",
    )
    inputs = (q, k, v, o, lse, do, q_lens, kv_lens, _zero_offsets(q_offsets, q_lens),
              _zero_offsets(kv_offsets, kv_lens), *_segment_operands(q, k, q_segment_ids, kv_segment_ids))
    dq, dk, dv, *_ = call(*inputs, deterministic=bool(deterministic),
                          **_attrs(scale, is_causal, window_left, window_right, softcap, q_segment_ids is not None))
    dq, dk, dv = _varying_like((dq, dk, dv), inputs)  # each device's own share, then:
    # Inside shard_map with check_vma, k or v may be invariant over manual axes that q or do vary over (K/V
    # replicated over a head or sequence axis): their cotangent is then the sum of every device's share, as JAX's
    # own transpose gives it.
    vma = frozenset().union(*(_vma(x) for x in inputs))
    dk, dv = (jax.lax.psum(d, tuple(sorted(vma - _vma(x)))) if vma - _vma(x) else d for d, x in ((dk, k), (dv, v)))
    dk, dv = _varying_like((dk,), (k,))[0], _varying_like((dv,), (v,))[0]
    return dq, dk, dv


#: Query rows (Tq) a decode call takes (kMaxDecodeQueryRows in cuda/ffi/validation.h), and packed query rows
#: (query heads per kv head x Tq) the decode kernel takes (kMaxDecodeRows in cuda/kernels/flash_api.h).
MAX_DECODE_QUERY_ROWS = 16
MAX_DECODE_ROWS = 128
#: Splits of the key range a decode call may ask for (kMaxDecodeSplits in cuda/kernels/decode/decode_traits.h).
MAX_DECODE_SPLITS = 1024


@functools.cache
def _sm_count():
    """Streaming multiprocessors of the first GPU (132, an H100's or H200's, when JAX sees none: the choice is then
    only traced, not run)."""
    try:
        return int(getattr(jax.devices("gpu")[0], "core_count", 0) or 132)
    except RuntimeError:
        return 132


#: Shared memory per SM (H100 / H200), for the decode grid when no GPU is visible.
_SMEM_PER_SM = 228 * 1024


def decode_splits(q_shape, heads_kv, capacity):
    """Parts of the key range for the decode kernel of q [B, Tq, Hq, D] over caches of `capacity` keys per sequence: as
    many blocks (batch x kv heads x splits) as the GPU holds at once (from the shared memory and
    threads of the split kernel the call will run, cuda/kernels/decode/decode_traits.h; the runtime keeps 1 KB of shared
    memory per block), so that one wave streams the cache with no tail; at least two key tiles (64 keys) per split, and
    the splits' float32 partial results (written and read back: 8 bytes per packed row and dim per split) at most about
    a quarter of the K/V bytes they stand for (an eighth left one sequence of 128 packed rows, which is bound by the
    tensor cores, on half the SMs); a long sequence of a balanced batch (decode_split_plan) may take up to twice
    this many splits, so up to half."""
    batch, rows, heads_q, head_dim = q_shape
    packed = heads_q // heads_kv * rows
    smem, threads = _jax_flash_cuda.decode_launch_shape(head_dim, packed, int(_kernel_choice()))
    per_sm = max(1, min(_SMEM_PER_SM // (smem + 1024), 2048 // max(threads, 1)))
    base = max(1, batch * heads_kv)
    want = max(1, per_sm * _sm_count() // base)
    return max(1, min(want, capacity // 128, capacity // (8 * packed), 256))


def decode_split_plan(q_shape, heads_kv, capacity):
    """(num_splits, balance_splits) of a decode call that leaves the split count to jax_flash: decode_splits' equal
    share for one sequence (or when one split fills the GPU); for a batch of several, twice that many splits of one
    size across the batch (the kernel gives each sequence as many as its length needs, FlashParams::balance_splits),
    so that ragged lengths keep every block streaming about as many keys."""
    splits = decode_splits(q_shape, heads_kv, capacity)
    if q_shape[0] < 2 or splits < 2:
        return splits, False
    return min(2 * splits, MAX_DECODE_SPLITS), True


def flash_decode(q, k_cache, v_cache, kv_lens, page_table=None, sinks=None, *, num_splits, scale, is_causal,
                 window_left, window_right, softcap=None, balance_splits=False):
    """Runs the decode target (CUDA only): the split-KV kernel and, with more than one split, its combine.

    Args:
      q: [B, Tq, Hq, D] (Tq <= 16; bfloat16 or float16); k_cache, v_cache: dense [B, S, Hkv, D], or paged
        [num_pages, page_size, Hkv, D] with page_table int32 [B, max_pages] (ids clamped into range by the kernel).
      kv_lens: int32 [B]: valid keys of each sequence (clamped to the capacity); query row t sits at position
        kv_lens[b] - Tq + t (bottom-right causal; windows from there).
      sinks: float32 [B, Hq] (broadcast from [Hq]) or None. num_splits: parts of the key range across blocks (each
        sequence's, or with balance_splits the most a sequence takes, see decode_split_plan).

    Returns:
      (o, lse): o like q; lse float32 [B, Hq, Tq], +inf for rows that see no key (as flash_fwd).
    """
    batch, rows, heads_q, head_dim = q.shape
    call = jax.ffi.ffi_call(
        DECODE_TARGET,
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads_q, rows), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, rows, heads_q, head_dim), jnp.float32),  # workspace
            jax.ShapeDtypeStruct((num_splits, batch, heads_q, rows), jnp.float32),  # workspace
        ),
        vmap_method="sequential",  # a paged cache is not batched like the query; vmap loops
    )
    paged = page_table is not None
    table = page_table if paged else _placeholder((batch,), np.int32)
    has_sinks = sinks is not None
    sinks = (_placeholder((batch,), np.float32) if sinks is None
             else jnp.broadcast_to(sinks.astype(jnp.float32), (batch, heads_q)))
    inputs = (q, k_cache, v_cache, kv_lens, table, sinks)
    o, lse, _, _ = call(*inputs, scale=np.float32(scale), is_causal=bool(is_causal),
                        window_left=np.int64(window_left), window_right=np.int64(window_right),
                        softcap=np.float32(0.0 if softcap is None else softcap), paged=paged, has_sinks=has_sinks,
                        balance_splits=bool(balance_splits), kernel=_kernel_choice())
    return _varying_like((o, lse), inputs)
