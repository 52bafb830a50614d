"""How a jax_flash kernel call partitions over sharded arrays (used by jax_flash.attention's custom_vjp rules).

Arrays: q [..., T, N, H], k and v [..., S, K, H], lengths int32 [...] (``...``: the batch dims, vmapped dims first),
o like q, lse float32 [..., N, T], and the optional ones: segment ids int32 [..., T] and [..., S] (they shard as
q's and k's rows) and sinks float32 [..., N] (as q's heads); None for an option a call does not use. Every device
computes the attention of its own block:

* batch dims and the head dim may be sharded: q's heads and k/v's heads go together (shard r of the head axis
  holds query heads [r N/s, (r+1) N/s) and kv heads [r K/s, (r+1) K/s)); with one kv head (K = 1) K and V are
  replicated to every head shard; otherwise K must be a multiple of the head axis size s, else ValueError naming
  the sizes. No collective, except that with K = 1 and sharded query heads the gradient all-reduces dK and dV
  over the head axis (every head shard holds a share of the one kv head's gradient).
* q's sequence dim may be sharded: K and V are all-gathered along their sequence (the only collective of the
  forward), each device runs its rows with their global position (``q_offsets``: axis index × local length),
  and in the backward dK and dV are summed over the sequence axes (each device holds its rows' share).
* head_dim and the kv sequence are never split: K/V sequence shardings are gathered.

Two mechanisms, by the mesh axes' type:

* ``Explicit`` axes (the sharding is in the types: ``jax.typeof(q).sharding``): the kernel runs under
  ``jax.shard_map`` with the specs read from q; K, V and the lengths are ``reshard``-ed to what the call needs.
* ``Auto`` axes (plain ``jit`` with in_shardings, or arrays placed with ``device_put``): a
  ``jax.experimental.custom_partitioning`` op with a Shardy sharding rule; its ``partition`` callback forces
  head_dim and the kv sequence replicated itself. ``custom_partitioning`` has no batching rule: a
  ``jax.custom_batching.custom_vmap`` around it keeps a vmapped axis as an extra leading (batch) dim.

With a single device in the process nothing changes: the kernel is called directly, as without this module. Inside
the user's own ``jax.shard_map`` (a Manual context) the kernel runs on each block as is; its results carry the
inputs' varying axes, and a K/V replicated over a manual axis that q varies over gets its summed cotangent (see
jax_flash._ffi.flash_bwd).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_flash import _ffi

try:
    _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - jax < 0.6
    from jax.experimental.shard_map import shard_map as _shard_map


def _axes(entry):
    """A PartitionSpec entry as a tuple of mesh axis names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes):
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _axis_size(mesh, axes):
    return math.prod(mesh.shape[a] for a in axes)


def _padded(spec, ndim):
    spec = tuple(spec)
    return spec + (None,) * (ndim - len(spec))


def _divisible(mesh, spec, shape):
    """spec without the shardings of dims their axes do not divide (those are gathered instead of padded)."""
    return tuple(e if shape[i] % _axis_size(mesh, _axes(e)) == 0 else None for i, e in enumerate(spec))


def _plan(mesh, q_spec, q_shape, num_kv_heads):
    """The specs of one call, given q's spec: a dict {role: PartitionSpec} over the roles of _FWD_ROLES and
    _BWD_ROLES, q's sequence axes, and the axes the backward sums dK and dV over."""
    q_spec = _divisible(mesh, _padded(q_spec, len(q_shape)), q_shape)
    num_q_heads = q_shape[-2]
    lead, seq, heads = q_spec[:-3], _axes(q_spec[-3]), _axes(q_spec[-2])
    # head_dim is never split (q_out below replicates it: a head_dim sharding is gathered).
    kv_heads = heads
    if heads and num_kv_heads > 1:
        size = _axis_size(mesh, heads)
        if num_kv_heads % size:
            raise ValueError(
                f"jax_flash.dot_product_attention: the query heads are sharded over mesh axes {heads} of size {size}, "
                f"which does not divide the {num_kv_heads} key/value heads ({num_q_heads} query heads): shard the "
                f"heads over an axis whose size divides {num_kv_heads}, or use one key/value head (replicated)")
    elif num_kv_heads == 1:
        kv_heads = ()
    specs = {
        "q": P(*lead, _entry(seq), _entry(heads), None),
        "kv": P(*lead, None, _entry(kv_heads), None),
        "lens": P(*lead),
        "lse": P(*lead, _entry(heads), _entry(seq)),
        "q_rows": P(*lead, _entry(seq)),  # q's segment ids
        "kv_rows": P(*lead, None),  # k's segment ids
        "q_heads": P(*lead, _entry(heads)),  # sinks
    }
    # dK, dV: each device holds the share of its query rows (sequence axes) and of its query heads (head axes that
    # K, V are replicated over); summed over those axes.
    reduce = seq + (heads if heads and not kv_heads else ())
    return specs, seq, reduce


# The roles of a call's arrays, in argument order (the optional ones last, dropped when None), and of its results.
_FWD_ROLES = ("q", "kv", "kv", "lens", "lens", "q_rows", "kv_rows", "q_heads", "lens")  # last: q_base
_FWD_RESULTS = ("q", "lse")
_BWD_ROLES = ("q", "kv", "kv", "q", "lse", "q", "lens", "lens", "q_rows", "kv_rows")
_BWD_RESULTS = ("q", "kv", "kv")


def _present(args, roles):
    """The non-None args, their roles, and a function that puts such arrays back in place of the Nones."""
    where = tuple(i for i, x in enumerate(args) if x is not None)

    def rebuild(present):
        full = [None] * len(args)
        for i, x in zip(where, present):
            full[i] = x
        return full

    return [args[i] for i in where], tuple(roles[i] for i in where), where, rebuild


def _q_offsets(seq_axes, local_len, lens):
    """The global position of this device's query row 0, int32 like lens (inside shard_map / a partition)."""
    if not seq_axes:
        return None
    index = jax.lax.axis_index(seq_axes[0] if len(seq_axes) == 1 else seq_axes)
    return jnp.full(lens.shape, index * local_len, jnp.int32)


# ---------------------------------------------------------------------------------------------------------------
# Which path


def _explicit_spec(x):
    """x's PartitionSpec if its type carries an Explicit sharding with some sharded dim, else None."""
    try:
        sharding = jax.typeof(x).sharding
    except Exception:  # noqa: BLE001 - no sharding in the type (old jax, or a plain value)
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
        return None
    explicit = {name for name, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}
    spec = _padded(sharding.spec, x.ndim)
    if any(set(_axes(e)) & explicit for e in spec):
        return mesh, spec
    return None


def cotangent_like(ct, primal):
    """`ct`, a cotangent summed from sharded shares (the sinks' gradient from every head or row shard), typed as its
    primal's must be: inside the user's shard_map summed over the manual axes it varies over and the primal does
    not; on a mesh of Explicit axes resharded to the primal's sharding (it would keep the shares' head sharding)."""
    extra = _ffi._vma(ct) - _ffi._vma(primal)
    if extra:
        ct = jax.lax.psum(ct, tuple(sorted(extra)))
    try:
        want, have = jax.typeof(primal).sharding, jax.typeof(ct).sharding
    except Exception:  # noqa: BLE001 - no sharding in the type (old jax, or a plain value)
        return ct
    mesh = getattr(want, "mesh", None)
    if not getattr(mesh, "explicit_axes", ()) or _padded(have.spec, ct.ndim) == _padded(want.spec, ct.ndim):
        return ct
    return _reshard(ct, mesh, want.spec)


def gather_pages(pool, pages):
    """pool[pages]: a page pool (num_pages, page_size, H, D) taken by an int32 table (B, max_pages) of ids in range.
    On a mesh of Explicit axes the gather's output sharding is stated (JAX cannot infer it): the table's batch, the
    pool's heads and dims; a pool split over its pages or rows, or a table over its pages, is gathered whole first."""
    found = _explicit_spec(pool) or _explicit_spec(pages)
    if found is None:
        return pool[pages]
    mesh = found[0]
    p_spec = _padded(jax.typeof(pool).sharding.spec, pool.ndim)
    t_spec = _padded(jax.typeof(pages).sharding.spec, pages.ndim)
    if p_spec[0] is not None or p_spec[1] is not None:
        pool = _reshard(pool, mesh, P(None, None, *p_spec[2:]))
    if t_spec[1] is not None:
        pages = _reshard(pages, mesh, P(t_spec[0], None))
    return pool.at[pages].get(out_sharding=NamedSharding(mesh, P(t_spec[0], None, None, *p_spec[2:])))


def _context_axis_types():
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # noqa: BLE001
        return ()
    return tuple(getattr(mesh, "axis_types", ())) if getattr(mesh, "axis_names", ()) else ()


def _path(q, k, v):
    if jax.device_count() == 1:
        return "local", None
    types = _context_axis_types()
    if jax.sharding.AxisType.Manual in types:
        # Inside shard_map: the arrays are per-device blocks. (Sharded Auto/Explicit axes left in a partly manual
        # context are not partitioned: every device computes its whole block.)
        return "local", None
    mixed = jax.sharding.AxisType.Explicit in types and jax.sharding.AxisType.Auto in types
    if mixed:  # (custom_partitioning fails on such a mesh inside JAX: the Auto axes cannot be partitioned)
        from jax_flash.attention import _warn_once

        _warn_once("sharding:mixed", "jax_flash: a mesh mixing Explicit and Auto axes: the Auto axes are not "
                   "partitioned (inputs sharded over them are gathered); use all-Explicit or all-Auto axes",
                   stacklevel=4)
    for x in (q, k, v):
        found = _explicit_spec(x)
        if found is not None:
            return "explicit", found[0]
    if mixed or (types and all(t == jax.sharding.AxisType.Explicit for t in types)):
        return "local", None  # replicated arrays on an Explicit mesh: every device computes everything
    return "auto", None


def forward(cfg, local_forward, q, k, v, q_lens, kv_lens, q_seg=None, kv_seg=None, sinks=None, q_base=None):
    """(o, lse) of the whole attention, partitioned as q is sharded. ``local_forward(cfg, q, k, v, q_lens, kv_lens,
    q_seg, kv_seg, sinks, q_offsets=None)`` runs one device's block. ``q_base`` (int32 [...], or None for 0): the
    global position of q's row 0 (decode: the rows sit at the end of the cache), added to a sequence shard's."""
    args = (q, k, v, q_lens, kv_lens, q_seg, kv_seg, sinks, q_base)
    path, mesh = _path(q, k, v)
    if path == "local":
        return local_forward(cfg, *args[:-1], q_offsets=q_base)
    if path == "explicit":
        return _explicit_call(cfg, local_forward, "fwd", mesh, args)
    present, _, where, _ = _present(args, _FWD_ROLES)
    return _auto_op(cfg, local_forward, "fwd", where)(*present)


def backward(cfg, local_backward, q, k, v, o, lse, do, q_lens, kv_lens, q_seg=None, kv_seg=None):
    """(dq, dk, dv), partitioned as q is sharded. ``local_backward(cfg, q, k, v, o, lse, do, q_lens, kv_lens,
    q_seg, kv_seg, q_offsets=None)`` runs one device's block."""
    args = (q, k, v, o, lse, do, q_lens, kv_lens, q_seg, kv_seg)
    path, mesh = _path(q, k, v)
    if path == "local":
        return local_backward(cfg, *args)
    if path == "explicit":
        return _explicit_call(cfg, local_backward, "bwd", mesh, args)
    present, _, where, _ = _present(args, _BWD_ROLES)
    return _auto_op(cfg, local_backward, "bwd", where)(*present)


def _local_body(cfg, local_fn, kind, seq, reduce, local_len, rebuild):
    """One device's call on the present arrays: the local function with its rows' global offset (and, backward,
    dK and dV summed over the axes that hold shares of them)."""

    def body(*present):
        args = rebuild(present)
        offsets = _q_offsets(seq, local_len, args[3 if kind == "fwd" else 6])
        if kind == "fwd":
            q_base = args.pop()
            if q_base is not None:
                offsets = q_base if offsets is None else offsets + q_base
        out = local_fn(cfg, *args, q_offsets=offsets)
        if kind == "bwd" and reduce:  # each device holds its rows' and heads' share of dK, dV
            dq, dk, dv = out
            dk, dv = jax.lax.psum((dk, dv), reduce)
            out = (dq, dk, dv)
        return out

    return body


# ---------------------------------------------------------------------------------------------------------------
# Explicit axes: shard_map


def _reshard(x, mesh, spec):
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def _explicit_call(cfg, local_fn, kind, mesh, args):
    """The call under shard_map: every array resharded to what its role needs, results back to the inputs'
    shardings (a head_dim sharding, gathered for the kernel, comes back)."""
    q, k = args[0], args[1]
    spec = _explicit_spec(q)
    specs, seq, reduce = _plan(mesh, spec[1] if spec is not None else (None,) * q.ndim, q.shape, k.shape[-2])
    local_len = q.shape[-3] // _axis_size(mesh, seq)
    present, roles, _, rebuild = _present(args, _FWD_ROLES if kind == "fwd" else _BWD_ROLES)
    results = _FWD_RESULTS if kind == "fwd" else _BWD_RESULTS
    shardings = [jax.typeof(x).sharding for x in (args[:1] if kind == "fwd" else args[:3])]
    present = [_reshard(x, mesh, specs[r]) for x, r in zip(present, roles)]
    out = _shard_map(_local_body(cfg, local_fn, kind, seq, reduce, local_len, rebuild), mesh=mesh,
                     in_specs=tuple(specs[r] for r in roles), out_specs=tuple(specs[r] for r in results),
                     check_vma=False)(*present)
    # (an input not on the mesh, such as a closed-over constant, has no sharding to go back to)
    back = [jax.sharding.reshard(x, sh) if getattr(sh.mesh, "axis_names", ()) else x for x, sh in zip(out, shardings)]
    return tuple(back) + tuple(out[len(back):])


# ---------------------------------------------------------------------------------------------------------------
# Auto axes: custom_partitioning with a Shardy rule, under a custom_vmap


def _rule(nlead, num_q_heads, num_kv_heads, kind, roles):
    """Shardy rule string and factor kwargs for arrays of the given roles."""
    lead = " ".join(f"b{i}" for i in range(nlead))
    group = num_q_heads // num_kv_heads
    if num_kv_heads == 1:
        qh, kh, extra = "n", "k", {}
    elif group == 1:
        qh, kh, extra = "h", "h", {}
    else:
        qh, kh, extra = "(h g)", "h", {"g": group}
    dims = {"q": f"{lead} t {qh} d", "kv": f"{lead} s {kh} d", "lens": lead, "lse": f"{lead} {qh} t",
            "q_rows": f"{lead} t", "kv_rows": f"{lead} s", "q_heads": f"{lead} {qh}"}
    results = _FWD_RESULTS if kind == "fwd" else _BWD_RESULTS
    rule = ", ".join(dims[r] for r in roles) + " -> " + ", ".join(dims[r] for r in results)
    return rule, dict(need_replication_factors=("d", "s"), **extra)


def _named_spec(sharding, ndim):
    spec = getattr(sharding, "spec", None)
    return _padded(spec if spec is not None else (), ndim)


@functools.cache
def _partitioned(cfg, local_fn, kind, where, nlead, num_q_heads, num_kv_heads):
    """The custom_partitioning op of one call signature (``where``: the positions of the arrays present)."""
    all_roles = _FWD_ROLES if kind == "fwd" else _BWD_ROLES
    roles = tuple(all_roles[i] for i in where)
    results = _FWD_RESULTS if kind == "fwd" else _BWD_RESULTS

    def rebuild(present):
        full = [None] * len(all_roles)
        for i, x in zip(where, present):
            full[i] = x
        return full

    # Under jit: custom_partitioning refuses a body with constants at its top level (the xla fallback has some).
    @jax.jit
    def fn(*present):
        return local_fn(cfg, *rebuild(present))

    op = custom_partitioning(fn)

    def partition(mesh, arg_shapes, result_shape):
        q_shape = arg_shapes[0]
        specs, seq, reduce = _plan(mesh, _named_spec(q_shape.sharding, len(q_shape.shape)), q_shape.shape,
                                   num_kv_heads)
        local_len = q_shape.shape[-3] // _axis_size(mesh, seq)
        ns = functools.partial(NamedSharding, mesh)
        lower = _local_body(cfg, local_fn, kind, seq, reduce, local_len, rebuild)
        return mesh, lower, tuple(ns(specs[r]) for r in results), tuple(ns(specs[r]) for r in roles)

    def infer(mesh, arg_shapes, result_shape):  # GSPMD (the non-Shardy partitioner)
        q_shape = arg_shapes[0]
        specs, _, _ = _plan(mesh, _named_spec(q_shape.sharding, len(q_shape.shape)), q_shape.shape, num_kv_heads)
        return tuple(NamedSharding(mesh, specs[r]) for r in results)

    rule, factors = _rule(nlead, num_q_heads, num_kv_heads, kind, roles)
    op.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule, **factors)
    return op


@functools.cache
def _auto_op(cfg, local_fn, kind, where):
    """custom_vmap(custom_partitioning op): a vmapped axis becomes one more leading batch dim."""

    @jax.custom_batching.custom_vmap
    def op(*args):
        q, k = args[0], args[1]
        return _partitioned(cfg, local_fn, kind, where, q.ndim - 3, q.shape[-2], k.shape[-2])(*args)

    @op.def_vmap
    def _vmap(axis_size, in_batched, *args):
        args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, batched in zip(args, in_batched)]
        out = op(*args)
        return out, jax.tree.map(lambda _: True, out)

    return op
