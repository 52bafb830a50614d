"""Shared helpers: random inputs, forward+backward runners, the accuracy check against a float64 reference, and the
check of results for inputs holding nan or inf.

Helpers reach the test modules through the ``attention_checks`` fixture; test modules describe cases as dicts of
``Case`` fields.
"""

import dataclasses
import functools
import os
import pathlib
import shutil
import subprocess
import types


def _share_cores_among_workers():
    """Under pytest-xdist (``-n N``) each worker is a process whose BLAS and OpenMP pools default to a thread per
    core, N x cores threads in all: with 8 workers on the GPU machine's 16 cores, run queues of ~100 and a GPU suite
    2.3x slower (NOTES, session 77). Gives each worker its share of the cores unless the caller chose. Runs before
    numpy is imported, which is when OpenBLAS reads these variables."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = str(max(1, cores // workers))
        for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, threads)


_share_cores_among_workers()

import jax  # noqa: E402 (after the thread counts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_flash  # noqa: E402
from jax_flash.reference import numpy_attention_fwd_bwd  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: shapes and mask options (lengths as tuples so cases hash and print)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    is_causal: bool = False
    window: int | tuple[int, int] | None = None
    q_lens: tuple[int, ...] | None = None
    kv_lens: tuple[int, ...] | None = None

    def kwargs(self):
        """Keyword arguments of dot_product_attention for this case."""
        return dict(
            is_causal=self.is_causal,
            local_window_size=self.window,
            query_seq_lengths=None if self.q_lens is None else np.array(self.q_lens, np.int32),
            key_value_seq_lengths=None if self.kv_lens is None else np.array(self.kv_lens, np.int32),
        )

    def visible(self):
        """Bool [B, 1, T, S] in numpy: key j visible to query row i (written out independently of jax_flash)."""
        i = np.arange(self.seqlen_q)[:, None]
        j = np.arange(self.seqlen_k)[None, :]
        mask = np.ones((self.batch, 1, self.seqlen_q, self.seqlen_k), bool)
        if self.is_causal:
            mask &= j <= i
        if self.window is not None:
            left, right = (self.window, self.window) if isinstance(self.window, int) else self.window
            mask &= (i - left <= j) & (j <= i + right)
        if self.q_lens is not None:
            mask &= i < np.array(self.q_lens)[:, None, None, None]
        if self.kv_lens is not None:
            mask &= j < np.array(self.kv_lens)[:, None, None, None]
        return mask

    def row_sees_key(self):
        """Bool [B, T]: the query row sees at least one key (rows past the query length see none)."""
        return self.visible().any(-1)[:, 0]

    def rows_like_jax_nn(self):
        """Bool [B, T]: rows where jax.nn's xla semantics equal ours (all but valid rows that see no key)."""
        rows = np.arange(self.seqlen_q)[None, :]
        q_lens = np.full((self.batch,), self.seqlen_q) if self.q_lens is None else np.array(self.q_lens)
        return self.row_sees_key() | (rows >= q_lens[:, None])


def make_inputs(case, dtype, seed=0):
    """Random normal q, k, v and output cotangent in `dtype` (drawn in float32 by numpy, then rounded)."""
    rng = np.random.default_rng(seed)
    shapes = [
        (case.batch, case.seqlen_q, case.heads_q, case.head_dim),
        (case.batch, case.seqlen_k, case.heads_kv, case.head_dim),
        (case.batch, case.seqlen_k, case.heads_kv, case.head_dim),
        (case.batch, case.seqlen_q, case.heads_q, case.head_dim),
    ]
    return [jnp.asarray(rng.standard_normal(s, np.float32).astype(dtype)) for s in shapes]


def fwd_bwd(attention, q, k, v, do, jit=True, **kwargs):
    """(out, dq, dk, dv) of `attention` (under jit unless `jit` is False), as float64 numpy arrays."""

    def run(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **kwargs), q, k, v)
        return (out, *vjp(do))

    return [np.asarray(x, np.float64) for x in (jax.jit(run) if jit else run)(q, k, v, do)]


def numpy_reference(case, q, k, v, do, scale=None):
    """(out, dq, dk, dv) in float64 numpy (jax_flash.reference.numpy_attention_fwd_bwd with the case's mask, written
    out here independently of jax_flash). test_reference.py checks it against jax_flash.reference_attention
    differentiated by JAX."""
    return numpy_attention_fwd_bwd(q, k, v, do, case.visible(), scale=scale)


def masked_reference(case, q, k, v, do, scale=None):
    """(out, dq, dk, dv) in float64 numpy, every sum running over the visible (row, key) pairs only.

    numpy_reference and jax.nn add masked pairs into their sums with weight 0; here they are left out, so a nan or
    inf input reaches exactly the entries that depend on it through visible pairs (never through 0 * nan). Semantics
    as jax_flash: rows that see no key output 0 with zero dq, keys that no row sees get zero dk and dv; a row whose
    visible logits are all -inf is 0 / 0 = nan. Products are spelt out elementwise (no BLAS) and one (batch, head)
    at a time: meant for small cases with non-finite inputs.
    """
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    scale = 1 / np.sqrt(case.head_dim) if scale is None else scale
    group = case.heads_q // case.heads_kv
    visible = np.broadcast_to(case.visible()[:, 0], (case.batch, case.seqlen_q, case.seqlen_k))
    out, dq, dk, dv = np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)

    def visible_sum(a, b, vis):
        """[T, H]: sum over s of a[t, s] * b[s, h], for the pairs (t, s) with vis[t, s] only."""
        return np.where(vis[:, :, None], a[:, :, None] * b[None], 0).sum(1)

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for b, n in np.ndindex(case.batch, case.heads_q):
            vis, kvh = visible[b], n // group
            qn, kn, vn, don = q[b, :, n], k[b, :, kvh], v[b, :, kvh], do[b, :, n]
            logits = np.where(vis, scale * (qn[:, None] * kn[None]).sum(-1), -np.inf)
            weights = np.where(vis, np.exp(logits - logits.max(1, keepdims=True)), 0)
            probs = np.where(vis, weights / weights.sum(1, keepdims=True), 0)
            o = visible_sum(probs, vn, vis)
            dprobs = (don[:, None] * vn[None]).sum(-1)
            dlogits = np.where(vis, probs * (dprobs - (don * o).sum(-1, keepdims=True)), 0)
            out[b, :, n] = o
            dq[b, :, n] = scale * visible_sum(dlogits, kn, vis)
            dk[b, :, kvh] += scale * visible_sum(dlogits.T, qn, vis.T)
            dv[b, :, kvh] += visible_sum(probs.T, don, vis.T)
    return [out, dq, dk, dv]


def max_abs(x):
    return float(np.max(np.abs(x))) if x.size else 0.0


def jax_nn_fwd_bwd(q, k, v, do, implementation="xla", **kwargs):
    """fwd_bwd of jax.nn.dot_product_attention with `implementation`.

    jax.nn's xla path asks for F16_F16_F32 dots, which XLA:CPU cannot compile; float16 on CPU runs eagerly, where it
    retries with the default precision.
    """
    jit = not (q.dtype == jnp.float16 and all(d.platform == "cpu" for d in q.devices()))
    return fwd_bwd(functools.partial(jax.nn.dot_product_attention, implementation=implementation), q, k, v, do,
                   jit=jit, **kwargs)


def check_against_reference(case, dtype, baseline_implementation="xla", seed=0, factor=3.0, **jax_flash_options):
    """Asserts jax_flash's output and gradients are within `factor` x the baseline's error vs float64.

    `jax_flash_options` (e.g. ``deterministic=True``) go to jax_flash only.

    The baseline is jax.nn.dot_product_attention with `baseline_implementation` in the same dtype. On rows where
    its semantics differ (valid rows that see no key) it is scored on the rows where they agree, with the
    cotangent zeroed on the others; jax_flash is scored everywhere and must output exact zeros there.
    """
    q, k, v, do = make_inputs(case, dtype, seed)
    kwargs = case.kwargs()
    ref = numpy_reference(case, q, k, v, do)
    ours = fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, **kwargs, **jax_flash_options)
    agree = case.rows_like_jax_nn()
    do_base = do * jnp.asarray(agree, do.dtype)[:, :, None, None]
    base = jax_nn_fwd_bwd(q, k, v, do_base, baseline_implementation, **kwargs)
    eps = float(jnp.finfo(dtype).eps)
    for name, x, b, r in zip(("output", "dq", "dk", "dv"), ours, base, ref):
        assert np.isfinite(x).all(), f"{case} {name}: non-finite values"
        err = max_abs(x - r)
        base_err = max_abs((b - r)[agree]) if name == "output" else max_abs(b - r)
        # Floors for a baseline that is exact by luck: 2 ulp of the largest value, plus float32 rounding of
        # head_dim-long dot products of O(1) inputs (a (0, 0) window makes dq exactly 0 in exact arithmetic, and
        # jax.nn's softmax gradient gets that 0 where a flash kernel's rowsum(dout * out) need not).
        bound = factor * base_err + 2 * eps * max_abs(r) + 1e-6 * np.sqrt(case.head_dim)
        assert err <= bound, f"{case} {dtype.__name__} {name}: error {err:.3g} > {bound:.3g} (baseline {base_err:.3g})"
    dead = ~case.row_sees_key()
    assert not np.any(ours[0][dead]), f"{case}: rows that see no key must output 0"
    assert not np.any(ours[1][dead]), f"{case}: rows that see no key must get dq = 0"


NONFINITE_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}  # check_nonfinite, by dtype name
NONFINITE_VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}

# Logits of one sign: +inf in dim 0 of query row 30 (of key 30), and every key (query) of that sign in dim 0.
INFINITE_LOGITS = {
    "row_all_plus_inf": ("q", 1.0),  # softmax(+inf, ..., +inf) = nan
    "row_all_minus_inf": ("q", -1.0),  # 0 / 0 = nan
    "column_plus_inf": ("k", 1.0),  # nan in every row
    "column_minus_inf": ("k", -1.0),  # weight 0: finite outputs; dq = 0 * -inf = nan in dim 0
}


def nonfinite_inputs(case, dtype, where, value, position, seed=0):
    """make_inputs with NONFINITE_VALUES[value] at `position` (batch, row or key, head, dim) of `where` (q, k or v)."""
    inputs = make_inputs(case, dtype, seed)
    i = "qkv".index(where)
    inputs[i] = inputs[i].at[position].set(NONFINITE_VALUES[value])
    return inputs


def infinite_logit_inputs(case, dtype, name, seed=0):
    """make_inputs with the logits of INFINITE_LOGITS[name]: query row 30 of head 1 or key 30 of kv head 1 (the
    case needs two heads)."""
    q, k, v, do = make_inputs(case, dtype, seed)
    where, sign = INFINITE_LOGITS[name]
    if where == "q":
        q = q.at[0, 30, 1, 0].set(np.inf)
        k = k.at[..., 0].set(sign * jnp.abs(k[..., 0]))
    else:
        k = k.at[0, 30, 1, 0].set(np.inf)
        q = q.at[..., 0].set(sign * jnp.abs(q[..., 0]))
    return q, k, v, do


def check_nonfinite(case, q, k, v, do):
    """Checks jax_flash's output and gradients for inputs holding nan or inf; returns the non-finite patterns
    (bool arrays for out, dq, dk, dv) of jax_flash and of jax.nn's xla implementation.

    * Every entry that depends on a non-finite input through a visible (row, key) pair (masked_reference) is
      non-finite.
    * Any other non-finite entry is non-finite in jax.nn too: jax.nn sums over masked pairs with weight 0, so the nan
      of 0 * nan reaches it from a masked position; jax_flash's kernels skip the key blocks a query block cannot see,
      but within a tile they too multiply masked pairs by 0.
    * Rows that see no key output exactly 0 and get dq = 0, and keys that no row sees get dk = dv = 0, whatever the
      inputs hold (jax.nn gives a valid row that sees no key the average of all values, and multiplies rows past
      the query length by 0, so nan stays nan there).
    * The finite entries are accurate (against masked_reference, relative to the largest finite value).
    """
    kwargs = case.kwargs()
    ours = fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, **kwargs)
    ref = masked_reference(case, q, k, v, do)
    base = jax_nn_fwd_bwd(q, k, v, do, **kwargs)
    tol = NONFINITE_TOL[q.dtype.name]
    ours_bad, base_bad = [], []
    for name, x, r, b in zip(("output", "dq", "dk", "dv"), ours, ref, base):
        bad, ref_bad, b_bad = ~np.isfinite(x), ~np.isfinite(r), ~np.isfinite(b)
        missing = ref_bad & ~bad
        assert not missing.any(), f"{case} {name}: finite at {np.argwhere(missing)[:5].tolist()}, where it depends " \
                                  "on a non-finite input"
        extra = bad & ~ref_bad & ~b_bad
        assert not extra.any(), f"{case} {name}: non-finite at {np.argwhere(extra)[:5].tolist()}, where neither " \
                                "jax.nn nor the masked reference is"
        finite = ~bad
        err = max_abs(x[finite] - r[finite])
        bound = tol * max(max_abs(r[finite]), 1.0)
        assert err <= bound, f"{case} {name}: error {err:.3g} > {bound:.3g} on the finite entries"
        ours_bad.append(bad)
        base_bad.append(b_bad)
    out, dq, dk, dv = ours
    dead_rows = ~case.row_sees_key()  # [B, T]
    dead_keys = ~case.visible().any(2)[:, 0]  # [B, S]
    assert not out[dead_rows].any() and not dq[dead_rows].any(), f"{case}: rows that see no key must stay 0"
    assert not dk[dead_keys].any() and not dv[dead_keys].any(), f"{case}: keys no row sees must get zero dk, dv"
    return ours_bad, base_bad


def check_nan_padding(case, dtype, seed):
    """Fills the padding of `case` (query rows past q_lens of batch 1, keys and values past kv_lens of batch 0) with
    nan and asserts the results equal those of zero padding, all finite. Returns the nan-padded inputs."""
    q, k, v, do = make_inputs(case, dtype, seed)
    zero_padded = fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, **case.kwargs())
    q_len, kv_len = case.q_lens[1], case.kv_lens[0]
    q, k, v = q.at[1, q_len:].set(np.nan), k.at[0, kv_len:].set(np.nan), v.at[0, kv_len:].set(np.nan)
    nan_padded = fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, **case.kwargs())
    for name, x, z in zip(("output", "dq", "dk", "dv"), nan_padded, zero_padded):
        assert np.isfinite(z).all(), name
        np.testing.assert_array_equal(x, z, err_msg=f"{name}: nan padding changed the results")
    return q, k, v, do


def sm90_backward_available():
    """The sm_90a backward runs on compute capability 9.0 unless JAX_FLASH_FORCE_SM80 is set."""
    device = jax.devices("gpu")[0]
    forced_sm80 = os.environ.get("JAX_FLASH_FORCE_SM80", "") not in ("", "0")
    return getattr(device, "compute_capability", "") == "9.0" and not forced_sm80


# Where the CUDA kernels can run (a GPU and jax_flash's CUDA build), modules that use each_platform run twice.
PLATFORMS = ["cpu"] + (["gpu"] if jax_flash.cuda_available() else [])


@pytest.fixture(params=PLATFORMS)
def each_platform(request, monkeypatch):
    """For test modules marked ``gpu`` that use it (``pytest.mark.usefixtures("each_platform")``): every test runs
    on the CPU and, where the CUDA kernels can run, on the GPU, with the default device set and each of the module's
    ``PLATFORM_VALUES`` (global name -> (CPU value, GPU value): dtype, tolerances) set as its global."""
    gpu = request.param == "gpu"
    for name, (cpu_value, gpu_value) in getattr(request.module, "PLATFORM_VALUES", {}).items():
        monkeypatch.setattr(request.module, name, gpu_value if gpu else cpu_value)
    with jax.default_device(jax.devices(request.param)[0]):
        yield request.param


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request):
    """Tests not marked ``gpu`` exercise the CPU kernels, also on a machine with a GPU."""
    if request.node.get_closest_marker("gpu"):
        yield
    else:
        with jax.default_device(jax.devices("cpu")[0]):
            yield


@pytest.fixture
def attention_checks():
    """The helpers above, for test modules."""
    return types.SimpleNamespace(
        Case=Case, make_inputs=make_inputs, fwd_bwd=fwd_bwd, numpy_reference=numpy_reference,
        masked_reference=masked_reference, max_abs=max_abs, check_against_reference=check_against_reference,
        nonfinite_inputs=nonfinite_inputs, infinite_logit_inputs=infinite_logit_inputs,
        check_nonfinite=check_nonfinite, check_nan_padding=check_nan_padding,
        sm90_backward_available=sm90_backward_available)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which fallback reasons jax_flash already warned about."""
    monkeypatch.setattr(jax_flash.attention, "_WARNED", set())


@pytest.fixture
def run_cpp_check(tmp_path):
    """Builds tests/cpp/<name>.cc against cuda/ with the system C++ compiler (skips without one), runs it and
    returns (exit status, stdout); the checks print "ok <cases>" or their first failures and exit 1 on any."""

    def run(name):
        if shutil.which("c++") is None:
            pytest.skip("needs a C++ compiler")
        root = pathlib.Path(__file__).resolve().parent.parent
        exe = tmp_path / name
        subprocess.run(["c++", "-std=c++17", "-O1", f"-I{root / 'cuda'}", str(root / "tests" / "cpp" / f"{name}.cc"),
                        "-o", str(exe)], check=True, capture_output=True, text=True)
        result = subprocess.run([str(exe)], capture_output=True, text=True)
        return result.returncode, result.stdout

    return run
