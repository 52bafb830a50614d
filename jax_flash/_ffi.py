"""Registration of the compiled FFI targets and thin wrappers that call them.

Two nanobind extensions carry the handlers: ``_jax_flash_cpu`` (always built) and ``_jax_flash_cuda`` (absent
from a CPU-only build). Each exposes ``registrations()``, a dict {target name: capsule} for the targets
``jax_flash_fwd``, ``jax_flash_bwd`` and ``jax_flash_segment_operands``, and the CUDA one also ``jax_flash_decode``.

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
SEGMENTS_TARGET = "jax_flash_segment_operands"

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
KERNELS = {"auto": 0, "sm80": 1, "sm80-small-smem": 2, "decode-cp-async": 3}
_forced_kernel = contextvars.ContextVar("jax_flash_forced_kernel", default=None)


@contextlib.contextmanager
def force_kernel(kernel):
    """Runs the jax_flash calls traced inside the ``with`` block on one CUDA kernel family.

    ``kernel``: ``"auto"`` (the sm_90a kernels on compute capability 9.0, the sm_80-class ones elsewhere),
    ``"sm80"`` (the sm_80-class kernels on any GPU), ``"sm80-small-smem"`` (also their backward, and whether the
    decode kernel fits, as on a device with 99 KB of shared memory a block) or ``"decode-cp-async"`` (``"auto"``,
    but decode calls that would run the sm_90a TMA decode kernel run the cp.async one). For tests and comparisons of
    both paths in one process. The choice is made when a call is traced: a function that ``jax.jit`` already
    compiled keeps the kernels it was traced with. The CPU has one kernel and ignores it. Without this context the
    environment variable ``JAX_FLASH_FORCE_SM80`` decides, read at each trace: unset or ``0`` for ``"auto"``,
    ``small-smem`` for ``"sm80-small-smem"``, anything else for ``"sm80"``.
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
#: Runs of equal ids per side and batch element that segment_operands still takes as intervals (kMaxSegmentRuns
#: in cuda/segment_operands.h); a batch element with more takes the per-tile id tests.
MAX_SEGMENT_RUNS = 2048


def segment_operands(q_segment_ids, kv_segment_ids):
    """The kernels' operands derived from segment ids (cuda/segment_operands.h), by the target SEGMENTS_TARGET.

    q_segment_ids int32 [..., T], kv_segment_ids int32 [..., S] (same leading dims) -> (q_meta [..., ceil(T / 16),
    4], kv_meta [..., ceil(S / 16), 4], q_runs [..., T, 2], kv_runs [..., S, 2]), int32:
    - q_meta (SegmentPolicy in cuda/mask.h): for query chunk c (rows [16 c, 16 c + 16)) the smallest and largest id
      of its rows, then [first, end): the hull of the keys whose 16-key chunks have an id range meeting chunk c's
      ([INT32_MAX, 0) when none does); kv_meta likewise with the roles swapped. The kernels skip key (query) tiles
      outside these ranges, so a packed batch costs about its visible area whatever the number of segments.
    - q_runs (RunPolicy): [first, last + 1) of the keys holding row i's id (an id no key holds: the empty interval
      [x, x) at the largest end of the rows before it, 0 at the start); kv_runs likewise. A batch element whose
      every id is one contiguous run of positions on the other side with bounds never decreasing along the positions
      (packed documents, whole or in parts: sharding, ring attention, prefill chunks), and with at most
      MAX_SEGMENT_RUNS runs of equal ids per side, takes these as an interval mask: no per-tile id tests. Any other
      batch element gets -1 in every entry of both and takes the ids with the metadata.
    Cost: on a GPU two small kernels (blocks of a batch element, a side and a part of its positions for the runs,
    each finding both sides' runs and writing its part; a thread per 16-position chunk for the metadata, whose work
    grows as (T / 16) x (S / 16)); on the CPU one pass per batch element.
    """
    lead = q_segment_ids.shape[:-1]
    t, s = q_segment_ids.shape[-1], kv_segment_ids.shape[-1]
    chunks = lambda n: -(-n // SEGMENT_CHUNK)  # noqa: E731
    call = jax.ffi.ffi_call(
        SEGMENTS_TARGET,
        tuple(jax.ShapeDtypeStruct(shape, jnp.int32)
              for shape in ((*lead, chunks(t), 4), (*lead, chunks(s), 4), (*lead, t, 2), (*lead, s, 2))),
        vmap_method="broadcast_all",
    )
    inputs = (q_segment_ids, kv_segment_ids)
    return _varying_like(call(*inputs), inputs)


def _placeholder(lead, dtype):
    """A one-element-per-batch-element stand-in of shape (*lead, 1) for an absent optional operand (never read;
    zero-size operands crash XLA:CPU inside an eager shard_map). A numpy array, so that it enters the program as a
    constant rather than as a kernel that fills it on every call, and not of one value: XLA turns a constant of
    equal elements into a broadcast, which runs as a kernel of its own before the call."""
    return np.arange(math.prod(lead), dtype=dtype).reshape(*lead, 1)


def _segment_operands(q, k, q_segment_ids, kv_segment_ids):
    """(q ids, kv ids, q meta, kv meta, q runs, kv runs) for the targets: placeholders when there are none."""
    if q_segment_ids is None:
        return (_placeholder(q.shape[:-3], np.int32),) * 6
    lead = q.shape[:-3]
    q_ids = jnp.broadcast_to(q_segment_ids.astype(jnp.int32), (*lead, q.shape[-3]))
    kv_ids = jnp.broadcast_to(kv_segment_ids.astype(jnp.int32), (*lead, k.shape[-3]))
    return (q_ids, kv_ids, *segment_operands(q_ids, kv_ids))


def _row_stats_shape(q_shape):
    """[..., Sq, Hq, D] -> [..., Hq, Sq]."""
    return (*q_shape[:-3], q_shape[-2], q_shape[-3])


def _fwd_counter_shape(q_shape):
    """[..., Sq, Hq, D] -> [..., 1]: the forward's work counter (workspace; kernels use its first int)."""
    return (*q_shape[:-3], 1)


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
      scale: logit scale, with scale * log2(e) a positive normal float32 (attention._kernel_scale folds other
        scales into q). is_causal: top-left aligned causal mask.
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
            jax.ShapeDtypeStruct(_fwd_counter_shape(q.shape), jnp.int32),  # work counter (workspace)
        ),
        vmap_method="broadcast_all",
    )
    has_sinks = sinks is not None
    sinks = (_placeholder(q.shape[:-3], np.float32) if sinks is None
             else jnp.broadcast_to(sinks.astype(jnp.float32), (*q.shape[:-3], q.shape[-2])))
    inputs = (q, k, v, q_lens, kv_lens, _zero_offsets(q_offsets, q_lens), _zero_offsets(kv_offsets, kv_lens),
              *_segment_operands(q, k, q_segment_ids, kv_segment_ids), sinks)
    attrs = _attrs(scale, is_causal, window_left, window_right, softcap, q_segment_ids is not None)
    o, lse, _ = call(*inputs, has_sinks=has_sinks, **attrs)
    return _varying_like((o, lse), inputs)


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


def _decode_blocks_per_sm(head_dim, packed_rows):
    """Blocks of the decode split kernel a call of `packed_rows` runs that one SM holds (from its shared memory and
    threads, cuda/kernels/decode/decode_traits.h; the runtime keeps 1 KB of shared memory per block)."""
    smem, threads = _jax_flash_cuda.decode_launch_shape(head_dim, packed_rows, int(_kernel_choice()))
    return max(1, min(_SMEM_PER_SM // (smem + 1024), 2048 // max(threads, 1)))


def decode_fits_device(head_dim, packed_rows):
    """Whether the decode kernel of `packed_rows` rows at `head_dim` fits the GPU's shared memory per block (above
    head dim 64 the sm_80-class kernel needs more than the 99 KB of sm_86 / sm_89 GPUs); True where no GPU answers."""
    return _decode_fits(head_dim, packed_rows, int(_kernel_choice()))


@functools.cache
def _decode_fits(head_dim, packed_rows, kernel):
    return cuda_device_count() == 0 or bool(_jax_flash_cuda.decode_fits_device(head_dim, packed_rows, kernel))


def attention_fits_device(head_dim, backward):
    """Whether the attention kernel of a forward (``backward=False``) or backward call at `head_dim` fits the GPU's
    shared memory per block (the sm_80-class kernels at head dim 256: the forward's 128 KB exceeds the 99 KB of
    sm_86 / sm_89 GPUs, the backward's 201 KB also sm_80's 163 KB); True where no GPU answers."""
    return _attention_fits(head_dim, bool(backward), int(_kernel_choice()))


@functools.cache
def _attention_fits(head_dim, backward, kernel):
    return cuda_device_count() == 0 or bool(_jax_flash_cuda.attention_fits_device(head_dim, backward, kernel))


def decode_splits(q_shape, heads_kv, capacity, paged=False):
    """Parts of the key range for the decode kernel of q [B, Tq, Hq, D] over caches of `capacity` keys per sequence: as
    many blocks (batch x kv heads x splits) as the GPU holds at once (from the shared memory and threads of the split
    kernel the call will run, cuda/kernels/decode/decode_traits.h; the runtime keeps 1 KB of shared memory per block),
    so that one wave streams the cache with no tail, except one block per SM for one sequence of a dense cache at one
    query row over at most 8 kv heads (each split then streams a long range: on an H200 one block an SM did so faster
    than two and left the combine fewer partials, 32/8 x 128 at one sequence of 131072 keys 127.2 µs against 129.3,
    where at Tq 16, over batches or from a paged cache it was up to 39 % slower; NOTES.md, session 29); at least two
    key tiles (64 keys) per split, and
    the splits' float32 partial results (written and read back: 8 bytes per packed row and dim per split) at most about
    a quarter of the K/V bytes they stand for (an eighth left one sequence of 128 packed rows, which is bound by the
    tensor cores, on half the SMs); a long sequence of a balanced batch (decode_split_plan) may take up to twice this
    many splits, so up to half."""
    batch, rows, heads_q, head_dim = q_shape
    packed = heads_q // heads_kv * rows
    base = max(1, batch * heads_kv)
    if batch == 1 and rows == 1 and heads_kv <= 8 and not paged:
        per_sm = 1
    else:
        per_sm = _decode_blocks_per_sm(head_dim, packed)
    want = max(1, per_sm * _sm_count() // base)
    return max(1, min(want, capacity // 128, capacity // (8 * packed), 256))


#: decode_split_plan balances a batch's splits when each sequence gets at most BALANCE_MAX_SPLITS splits, of at least
#: BALANCE_MIN_SPLIT_KEYS keys of the cache each or over at least BALANCE_MIN_PAIRS (sequence, kv head) pairs.
BALANCE_MAX_SPLITS = 8
BALANCE_MIN_SPLIT_KEYS = 4096
BALANCE_MIN_PAIRS = 64


#: decode_split_plan for a batch whose sequences are known to be equally long: the fewest splits a sequence that give
#: at least this fraction of the GPU's block slots a block (no combine where one split does) ...
UNIFORM_MIN_FILL = 0.9
#: ... counting one slot an SM up to this many packed rows (the mma.sync kernel's one or two row tiles), else the
#: blocks an SM the kernel holds; past UNIFORM_MAX_ROWS (sm_90a's TMA kernel) and for paged caches the ordinary
#: plan.
UNIFORM_ONE_BLOCK_ROWS = 32
UNIFORM_MAX_ROWS = 64


def uniform_splits(q_shape, heads_kv, capacity):
    """Splits a sequence for a batch of two or more sequences that are all equally long (kv_lengths given as one
    scalar, or jax.nn-style calls without lengths): the fewest that give UNIFORM_MIN_FILL of the block slots a block,
    never more than decode_splits' count. At equal lengths every block streams as many keys, and one split a sequence
    needs no combine kernel. On an H200 (NOTES.md, sessions 57 and 59: forced plans, dense caches, equal lengths),
    for up to 32 packed rows one block an SM streams as fast as two: 32/8 x 128 at 16 x 4160 took 65.8 us with one
    split against 71.7 with the ragged plan's 4, 8/1 at 64 x 8192 69.5 with two against 72.3 with 8, 32/8 at
    8 x 32768 242.5 with two against 249.4 (Tq 1; Tq 4 and 8 alike); 33-64 packed rows (sm_90a's wgmma kernel)
    want two blocks an SM: 32/8 at Tq 16, 16 x 4160 76.3 us with 2 splits against 78.7 with one, at 8 x 32768 249.1
    with 4 against 288.6 with 2. Past 64 packed rows (the TMA kernel, one block an SM) the ordinary plan stays: the
    equal-lengths count measured +2.6 % at 8/1 x 128, Tq 16, 64 x 8192 and -2.1 % at 64/8 8 x 32768, inside that
    kernel's spread; decode_split_plan does not call this there. Nor for paged caches, where one block an SM reads
    pages slower than two (32/8 at 8 x 32768, pages of 16, Tq 1: 374 us with two splits against 257 with the
    ordinary plan's balanced 8)."""
    batch, rows, heads_q, head_dim = q_shape
    packed = heads_q // heads_kv * rows
    per_sm = 1 if packed <= UNIFORM_ONE_BLOCK_ROWS else _decode_blocks_per_sm(head_dim, packed)
    want = max(1, math.ceil(UNIFORM_MIN_FILL * per_sm * _sm_count() / max(1, batch * heads_kv)))
    return min(want, decode_splits(q_shape, heads_kv, capacity))


def decode_split_plan(q_shape, heads_kv, capacity, paged=False, uniform=False):
    """(num_splits, balance_splits) of a decode call that leaves the split count to jax_flash. With ``uniform`` (every
    sequence of a batch of two or more equally long, which the caller states: the lengths are device values), a dense
    cache and up to UNIFORM_MAX_ROWS packed rows, uniform_splits' count, unbalanced. Otherwise decode_splits' equal
    share of each sequence's keys, or for a batch whose sequences get few splits (at most BALANCE_MAX_SPLITS) that are
    long (BALANCE_MIN_SPLIT_KEYS keys of the cache) or over many (sequence, kv head) pairs (BALANCE_MIN_PAIRS), twice
    that many splits of one size across the batch (the kernel gives each sequence as many as its length needs,
    FlashParams::balance_splits), so that ragged lengths keep every block streaming about as many keys. The balanced
    grid has twice the blocks, half of them without keys at equal lengths. On an H200 (NOTES.md, session 46: 8/1, 32/8,
    64/8 at Tq 1, 4, 16 over 2-64 sequences) it took 5-25 % off ragged batches where it is kept and cost 2-3 % at equal
    lengths; with many splits a sequence, or few short ones over few pairs (8/1 at 2-32 sequences), it cost 4-19 % even
    over ragged lengths.

    Where only the pairs ask for it (short splits) at one query row, head dims up to 128 and a dense cache, the grid
    keeps twice the splits but each sequence's equal share of them (no balancing): on an H200 (NOTES.md, session 57;
    tools/decode_plan_sweep.py, four ragged draws a shape) that was 0-2.5 % faster at equal lengths and over ragged
    ones level (8/1 at 64 x 8192) to 3-10 % faster (32/8 x 128 at 16 sequences of 4160 keys), where at Tq 4 and at
    head dim 256 balancing stayed ahead (by 1-10 %)."""
    batch, rows, heads_q, head_dim = q_shape
    if uniform and batch >= 2 and not paged and heads_q // heads_kv * rows <= UNIFORM_MAX_ROWS:
        return uniform_splits(q_shape, heads_kv, capacity), False
    splits = decode_splits(q_shape, heads_kv, capacity, paged)
    if not (batch >= 2 and 2 <= splits <= BALANCE_MAX_SPLITS):
        return splits, False
    if capacity >= BALANCE_MIN_SPLIT_KEYS * splits:
        return balanced_split_plan(splits)
    if batch * heads_kv >= BALANCE_MIN_PAIRS:
        if rows == 1 and head_dim <= 128 and not paged:
            return min(2 * splits, MAX_DECODE_SPLITS), False
        return balanced_split_plan(splits)
    return splits, False


def balanced_split_plan(splits):
    """(num_splits, True): the balanced grid for decode_splits' count `splits`, twice as many splits of one size
    across the batch."""
    return min(2 * splits, MAX_DECODE_SPLITS), True


def flash_decode(q, k_cache, v_cache, kv_lens, page_table=None, sinks=None, *, num_splits, scale, is_causal,
                 window_left, window_right, softcap=None, balance_splits=False, equal_lengths=False):
    """Runs the decode target (CUDA only): the split-KV kernel and, with more than one split, its combine.

    Args:
      q: [B, Tq, Hq, D] (Tq <= 16; bfloat16 or float16); k_cache, v_cache: dense [B, S, Hkv, D], or paged
        [num_pages, page_size, Hkv, D] with page_table int32 [B, max_pages] (ids clamped into range by the kernel).
      kv_lens: int32 [B]: valid keys of each sequence (clamped to the capacity); query row t sits at position
        kv_lens[b] - Tq + t (bottom-right causal; windows from there).
      sinks: float32 [B, Hq] (broadcast from [Hq]) or None. num_splits: parts of the key range across blocks (each
        sequence's, or with balance_splits the most a sequence takes, see decode_split_plan). equal_lengths: every
        kv_lens entry is the same (the caller gave one length): the launchers skip the longest-first ranking, which
        keeps the TMA kernel's unranked forms (an early Q and first key tile, or a persistent grid: see
        cuda/kernels/sm90/launch_decode_sm90.cuh).

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
            jax.ShapeDtypeStruct((1,), jnp.int32),  # workspace: a persistent TMA grid's work counter (else unused)
        ),
        vmap_method="sequential",  # a paged cache is not batched like the query; vmap loops
    )
    paged = page_table is not None
    table = page_table if paged else _placeholder((batch,), np.int32)
    has_sinks = sinks is not None
    sinks = (_placeholder((batch,), np.float32) if sinks is None
             else jnp.broadcast_to(sinks.astype(jnp.float32), (batch, heads_q)))
    inputs = (q, k_cache, v_cache, kv_lens, table, sinks)
    o, lse, *_ = call(*inputs, scale=np.float32(scale), is_causal=bool(is_causal),
                      window_left=np.int64(window_left), window_right=np.int64(window_right),
                      softcap=np.float32(0.0 if softcap is None else softcap), paged=paged, has_sinks=has_sinks,
                      balance_splits=bool(balance_splits), equal_lengths=bool(equal_lengths),
                      kernel=_kernel_choice())
    return _varying_like((o, lse), inputs)
