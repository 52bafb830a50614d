"""Shared helpers: random inputs, forward+backward runners, and the accuracy check against a float64 reference.

Helpers reach the test modules through the ``attention_checks`` fixture; test modules describe cases as dicts of
``Case`` fields.
"""

import dataclasses
import functools
import pathlib
import shutil
import subprocess
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash


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
    """(out, dq, dk, dv) in float64 numpy, from a materialised softmax and its hand-written gradient.

    Semantics as jax_flash: rows that see no key output 0 and pass no gradient. test_reference.py checks this
    against jax_flash.reference_attention differentiated by JAX.
    """
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    scale = 1 / np.sqrt(case.head_dim) if scale is None else scale
    group = case.heads_q // case.heads_kv
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)

    def einsum(spec, a, b):
        return np.einsum(spec, a, b, optimize=True)

    logits = np.where(case.visible(), scale * einsum("btnh,bsnh->bnts", q, k_rep), -np.inf)
    row_max = logits.max(-1, keepdims=True)
    weights = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0))
    denom = weights.sum(-1, keepdims=True)
    probs = weights / np.where(denom > 0, denom, 1)
    out = einsum("bnts,bsnh->btnh", probs, v_rep)
    dprobs = einsum("btnh,bsnh->bnts", do, v_rep)
    dlogits = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True))
    dq = scale * einsum("bnts,bsnh->btnh", dlogits, k_rep)

    def sum_groups(x):  # [B, S, N, H] -> [B, S, K, H]
        return x.reshape(*x.shape[:2], case.heads_kv, group, x.shape[-1]).sum(3)

    dk = sum_groups(scale * einsum("bnts,btnh->bsnh", dlogits, q))
    dv = sum_groups(einsum("bnts,btnh->bsnh", probs, do))
    return [out, dq, dk, dv]


def max_abs(x):
    return float(np.max(np.abs(x))) if x.size else 0.0


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
    # jax.nn's xla path asks for F16_F16_F32 dots, which XLA:CPU cannot compile; run eagerly, it then retries with
    # the default precision.
    jit_base = not (dtype == jnp.float16 and all(d.platform == "cpu" for d in q.devices()))
    base = fwd_bwd(functools.partial(jax.nn.dot_product_attention, implementation=baseline_implementation),
                   q, k, v, do_base, jit=jit_base, **kwargs)
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
        max_abs=max_abs, check_against_reference=check_against_reference)


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
