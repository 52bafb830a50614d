"""dot_product_attention's segment ids (packed sequences), attention sinks and logit soft-capping: forward and every
gradient (the sinks' included) against the float64 reference, in float32 on the CPU and bfloat16 on a GPU (conftest's
each_platform runs both where a GPU is); transformations; residuals; validation; the kernels run every option; the
segment metadata that lets the kernels skip tiles; the xla fallback (platforms without a kernel) agrees.

The bound: jax_flash's error against float64 at most 3x that of the materialised reference
(jax_flash.reference_attention) in the same dtype, plus 2 ulp of the largest value."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import attention as attention_module
from jax_flash.reference import attention_with_lse, numpy_attention_fwd_bwd, visible_mask

# Every test runs on the CPU (float32) and, where the CUDA kernels can run, on the GPU (bfloat16): conftest's
# each_platform sets the default device and these module values for each.
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("each_platform")]
PLATFORM_VALUES = {"ON_GPU": (False, True), "DTYPE": (jnp.float32, jnp.bfloat16)}
ON_GPU = False
DTYPE = jnp.float32


def _segments(rng, batch, length, kind):
    """int32 [batch, length] segment ids, a different packing per batch row."""
    rows = []
    for b in range(batch):
        if kind == "packed":  # documents of random lengths, ids counting up
            cuts = np.sort(rng.choice(np.arange(1, length), size=min(4 + b, length - 1), replace=False))
            rows.append(np.searchsorted(cuts, np.arange(length), side="right"))
        elif kind == "mixed":  # even rows packed (runs: the kernels' interval path), odd rows with the first
            # document's id again at the end (not runs: the id path)
            cuts = np.sort(rng.choice(np.arange(1, length), size=min(4 + b, length - 1), replace=False))
            row = np.searchsorted(cuts, np.arange(length), side="right")
            rows.append(np.where(row == row.max(), 0, row) if b % 2 else row)
        elif kind == "one":
            rows.append(np.zeros(length, int))
        elif kind == "sorted":  # 5 documents of random lengths (the same count for both sides of a call)
            cuts = np.sort(rng.choice(np.arange(1, length), size=4, replace=False))
            rows.append(np.searchsorted(cuts, np.arange(length), side="right"))
        else:  # "random": ids in any order (not sorted), a few values
            rows.append(rng.integers(0, 3, length))
    return jnp.asarray(np.stack(rows), jnp.int32)


CASES = {
    "packed_causal_gqa": dict(batch=3, t=97, s=97, n=4, k=2, h=64, is_causal=True, segments="packed"),
    "packed_padding_ids": dict(batch=2, t=61, s=61, n=2, k=2, h=32, is_causal=True, segments="packed",
                               pad=10),
    "random_ids_sq_ne_sk_window": dict(batch=2, t=33, s=61, n=4, k=1, h=64, window=(5, 9), segments="random"),
    "segments_lengths": dict(batch=3, t=40, s=40, n=2, k=2, h=32, segments="packed", q_lens=(40, 7, 0),
                             kv_lens=(40, 3, 12)),
    "sinks_causal_gqa": dict(batch=2, t=97, s=97, n=8, k=2, h=64, is_causal=True, sinks=True),
    "sinks_lengths_dead_rows": dict(batch=3, t=33, s=47, n=2, k=2, h=32, sinks=True, q_lens=(33, 5, 20),
                                    kv_lens=(47, 1, 0)),
    "softcap_window": dict(batch=2, t=61, s=61, n=2, k=2, h=64, window=(7, 3), softcap=2.0),
    "softcap_causal_d128": dict(batch=1, t=97, s=97, n=4, k=4, h=128, is_causal=True, softcap=30.0),
    "all_combined": dict(batch=2, t=61, s=47, n=4, k=2, h=64, is_causal=True, window=(20, 0), segments="random",
                         sinks=True, softcap=5.0, q_lens=(61, 30), kv_lens=(47, 40)),
    # Long enough for several query and key tiles per document: skipped tiles, one-id (unmasked) tiles, tiles
    # across document boundaries.
    "packed_long_causal": dict(batch=2, t=700, s=700, n=2, k=1, h=64, is_causal=True, segments="packed"),
    "packed_long_d128_sinks_softcap": dict(batch=1, t=520, s=520, n=2, k=2, h=128, is_causal=True,
                                           segments="packed", sinks=True, softcap=20.0),
    "packed_long_d256_noncausal": dict(batch=1, t=300, s=300, n=2, k=1, h=256, segments="packed"),
    "packed_sq_ne_sk_d128": dict(batch=2, t=200, s=450, n=4, k=2, h=128, segments="packed_kv_longer"),
    # Batch elements whose ids are runs (interval path) beside ones whose ids are not (id path), in one call.
    "mixed_runs_and_ids_window": dict(batch=3, t=300, s=300, n=2, k=1, h=64, window=(90, 20), segments="mixed"),
    "mixed_runs_and_ids_causal_d128": dict(batch=2, t=400, s=400, n=2, k=2, h=128, is_causal=True,
                                           segments="mixed"),
    "runs_sq_ne_sk_causal_window": dict(batch=2, t=130, s=300, n=2, k=1, h=64, is_causal=True, window=(100, 0),
                                        segments="packed_kv_longer"),
    # A query block inside one run whose keys start later (the forward's main loop drops the runs for such a block):
    # under a causal mask its first rows see no key of their run (output 0, zero gradients); d64's 192-row blocks
    # straddle the run's first key, d128's 128-row ones do not.
    "runs_block_before_its_keys_d64": dict(batch=1, t=400, s=600, n=2, k=1, h=64, is_causal=True,
                                           segments="kv_run_late"),
    "runs_block_before_its_keys_d128": dict(batch=1, t=400, s=600, n=2, k=1, h=128, is_causal=True,
                                            segments="kv_run_late"),
    # Soft cap over key tiles that every row sees (the kernels' unmasked steps): logits of standard deviation ~1,
    # and amplified ones (amp: q's scale) whose capped logits reach +-30 and beyond c/2, with weights that underflow;
    # head dims 64 and 128 (three-warpgroup forwards without a mask) and 256.
    "softcap_long_noncausal_d128": dict(batch=2, t=300, s=530, n=4, k=2, h=128, softcap=3.0),
    # The capped d128 forward without a mask runs three warpgroups over 192-row tiles and 64-key tiles (sm_90a):
    # with both segment-id policies (runs and ids grids), sinks, Sq != Sk, and last row tiles of 66 and 8 rows
    # (warpgroups without rows).
    "softcap_mixed_runs_and_ids_noncausal_d128": dict(batch=2, t=450, s=450, n=4, k=2, h=128, segments="mixed",
                                                      sinks=True, softcap=20.0),
    "softcap_packed_sq_ne_sk_d128": dict(batch=2, t=200, s=450, n=4, k=2, h=128, segments="packed_kv_longer",
                                         softcap=30.0),
    # Causal capped d128: below 4096 query rows on two warpgroups (mixed runs and ids with sinks, query and key
    # lengths, Sq > Sk, Sq < Sk); from 4096 on the three above as a CTA per block (gpu_only: the float64 reference
    # of 2 x 2 x 8195^2 scores would take the CPU pass minutes), each warpgroup computing only the key tiles up to its
    # own rows' last (a 192-row diagonal's three 64-key tiles are seen by one, two and three of them; a last block of
    # 131 rows, its third warpgroup's 3; rows past a query length, none): mixed runs and ids with sinks, and GQA with
    # sinks and query/key lengths.
    "softcap_causal_mixed_runs_and_ids_d128": dict(batch=2, t=450, s=450, n=4, k=2, h=128, is_causal=True,
                                                   segments="mixed", sinks=True, softcap=20.0),
    "softcap_causal_lengths_d128": dict(batch=3, t=400, s=400, n=4, k=2, h=128, is_causal=True, softcap=30.0,
                                        q_lens=(400, 130, 0), kv_lens=(400, 77, 5)),
    "softcap_causal_sq_gt_sk_d128": dict(batch=1, t=450, s=200, n=4, k=1, h=128, is_causal=True, softcap=10.0),
    "softcap_causal_sq_lt_sk_d128": dict(batch=1, t=250, s=700, n=2, k=1, h=128, is_causal=True, softcap=50.0,
                                         amp=4.0),
    "softcap_causal_long_mixed_runs_and_ids_d128": dict(batch=2, t=8195, s=8195, n=2, k=1, h=128, is_causal=True,
                                                        segments="mixed", sinks=True, softcap=20.0, gpu_only=True),
    "softcap_causal_long_gqa_lengths_d128": dict(batch=2, t=4300, s=4300, n=4, k=2, h=128, is_causal=True,
                                                 sinks=True, softcap=30.0, q_lens=(4300, 1000), kv_lens=(4300, 999),
                                                 gpu_only=True),
    "softcap_long_saturated_d128": dict(batch=1, t=200, s=700, n=2, k=1, h=128, softcap=50.0, amp=12.0),
    "softcap_long_causal_d64": dict(batch=1, t=700, s=700, n=2, k=2, h=64, is_causal=True, softcap=20.0, amp=3.0),
    "softcap_long_d256": dict(batch=1, t=300, s=300, n=2, k=1, h=256, softcap=10.0, amp=2.0),
    "softcap_long_noncausal_d64": dict(batch=1, t=400, s=530, n=4, k=2, h=64, softcap=5.0, amp=3.0),
    # Caps past the sm_90a forward's fixed-reference bound (SoftCap::fixed_reference_holds: c <= 56.8) take its
    # running maximum; rows whose every logit saturates at -c or +c (saturate: q rows along -/+ the keys' common
    # direction) test the fixed reference's range at its edge (c = 56: a row at -c is 2^-100 under it; a reference
    # of c log2(e) would flush the whole row to 0) and the running maximum past it.
    "softcap_large_cap_d128": dict(batch=1, t=200, s=530, n=2, k=1, h=128, softcap=120.0, amp=20.0),
    "softcap_saturated_rows_c56_d128": dict(batch=1, t=200, s=530, n=2, k=1, h=128, softcap=56.0, saturate=100.0),
    "softcap_saturated_rows_c57_d128": dict(batch=1, t=200, s=530, n=2, k=1, h=128, softcap=57.0, saturate=100.0),
    "softcap_saturated_rows_causal_c30_d64": dict(batch=1, t=260, s=260, n=2, k=1, h=64, is_causal=True,
                                                  softcap=30.0, saturate=50.0),
    # A cap below the softmax scale (the tanh's argument pre * q.k with pre = scale / c > 1), with q scaled so the
    # capped logits' tanh works in its curved range.
    "softcap_below_scale_d128": dict(batch=1, t=200, s=330, n=4, k=2, h=128, is_causal=True, softcap=0.05, amp=0.05),
}


def _problem(case, seed=0):
    """(q, k, v, do, kwargs) of a case in DTYPE; sinks (float32) among the kwargs."""
    rng = np.random.default_rng(seed)
    b, t, s, n, kh, h = (case[x] for x in ("batch", "t", "s", "n", "k", "h"))
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape, np.float32) * amp, DTYPE)
                   for shape, amp in (((b, t, n, h), case.get("amp", 1.0)), ((b, s, kh, h), 1.0),
                                      ((b, s, kh, h), 1.0), ((b, t, n, h), 1.0)))
    if "saturate" in case:  # keys near one direction u; query rows -a u, a u and random ones in turn
        u = rng.standard_normal(h).astype(np.float32)
        k = jnp.asarray(u + 0.3 * rng.standard_normal((b, s, kh, h), np.float32), DTYPE)
        sign = np.array([-1.0, 1.0, 0.0], np.float32)[np.arange(t) % 3][None, :, None, None]
        q = jnp.asarray(np.where(sign == 0, np.asarray(q, np.float32), sign * case["saturate"] * u), DTYPE)
    kw = dict(is_causal=case.get("is_causal", False), local_window_size=case.get("window"))
    if case.get("segments") == "kv_run_late":  # id 1: rows [0, 300), keys [128, 528); id 2 after; id 0 keys only
        kw["q_segment_ids"] = jnp.asarray(np.repeat([[1, 2]], [300, t - 300], axis=1).repeat(b, 0), jnp.int32)
        kw["kv_segment_ids"] = jnp.asarray(np.repeat([[0, 1, 2]], [128, 400, s - 528], axis=1).repeat(b, 0),
                                           jnp.int32)
    elif case.get("segments") == "packed_kv_longer":  # Sq != Sk: 5 documents on each side, of other lengths
        kw["q_segment_ids"] = _segments(rng, b, t, "sorted")
        kw["kv_segment_ids"] = _segments(rng, b, s, "sorted")
    elif "segments" in case:
        kw["q_segment_ids"] = _segments(rng, b, t, case["segments"])
        kw["kv_segment_ids"] = _segments(rng, b, s, case["segments"]) if t != s or case["segments"] == "random" \
            else kw["q_segment_ids"]
        if case.get("pad"):  # padding rows: an id that no key has
            kw["q_segment_ids"] = kw["q_segment_ids"].at[:, -case["pad"]:].set(-1)
    if case.get("sinks"):
        kw["sinks"] = jnp.asarray(rng.standard_normal(n) * 2, jnp.float32)
    if "softcap" in case:
        kw["logits_soft_cap"] = case["softcap"]
    if "q_lens" in case:
        kw["query_seq_lengths"] = jnp.asarray(case["q_lens"], jnp.int32)
        kw["key_value_seq_lengths"] = jnp.asarray(case["kv_lens"], jnp.int32)
    return q, k, v, do, kw


def _fwd_bwd(fn, q, k, v, do, kw):
    """(out, dq, dk, dv[, dsinks]) of fn under jit, as float64 numpy."""
    sinks = kw.get("sinks")
    rest = {name: x for name, x in kw.items() if name != "sinks"}

    def run(q, k, v, sinks):
        out, vjp = jax.vjp(lambda q, k, v, sinks: fn(q, k, v, sinks=sinks, **rest), q, k, v, sinks)
        grads = vjp(do.astype(out.dtype))
        return (out, *grads[:3]) + ((grads[3],) if sinks is not None else ())

    return [np.asarray(x, np.float64) for x in jax.jit(run)(q, k, v, sinks)]


def _reference64(q, k, v, do, kw):
    vis = visible_mask(q.shape[1], k.shape[1], is_causal=kw["is_causal"], local_window_size=kw["local_window_size"],
                       query_seq_lengths=kw.get("query_seq_lengths"),
                       key_value_seq_lengths=kw.get("key_value_seq_lengths"), q_segment_ids=kw.get("q_segment_ids"),
                       kv_segment_ids=kw.get("kv_segment_ids"))
    return numpy_attention_fwd_bwd(q, k, v, do, vis, sinks=kw.get("sinks"), logits_soft_cap=kw.get("logits_soft_cap"))


def _baseline(q, k, v, sinks=None, **kw):
    """The materialised reference in the inputs' dtype, with jax_flash's argument names."""
    kw = {name: x for name, x in kw.items() if x is not None}
    return jax_flash.reference_attention(q, k, v, sinks=sinks, **kw)


def _assert_near_reference(name, ours, base, ref, dtype):
    """Each of ours (output, dq, dk, dv[, dsinks]) finite and within 3x the materialised reference's error in dtype
    (base) of the float64 reference, plus 2 eps of its largest magnitude."""
    eps = float(jnp.finfo(dtype).eps)
    for label, x, b, r in zip(("output", "dq", "dk", "dv", "dsinks"), ours, base, ref):
        assert np.isfinite(x).all(), f"{name} {label}: non-finite values"
        err, base_err = np.abs(x - r).max(), np.abs(b - r).max()
        bound = 3 * base_err + 2 * eps * np.abs(r).max() + 1e-6
        assert err <= bound, f"{name} {label}: error {err:.3g} > {bound:.3g} (reference in " \
                             f"{jnp.dtype(dtype).name}: {base_err:.3g})"


@pytest.mark.parametrize("name", CASES)
def test_matches_float64_reference(name):
    if CASES[name].get("gpu_only") and not ON_GPU:
        pytest.skip("a GPU kernel's case, too long for the CPU pass")
    q, k, v, do, kw = _problem(CASES[name])
    ref = _reference64(q, k, v, do, kw)
    ours = _fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, kw)
    base = _fwd_bwd(_baseline, q, k, v, do, kw)
    assert len(ours) == len(ref)
    _assert_near_reference(name, ours, base, ref, DTYPE)
    # Rows that see no key (padding ids, lengths, no key of their segment) output 0 and get dq = 0.
    vis = np.asarray(visible_mask(q.shape[1], k.shape[1], is_causal=kw["is_causal"],
                                  local_window_size=kw["local_window_size"],
                                  query_seq_lengths=kw.get("query_seq_lengths"),
                                  key_value_seq_lengths=kw.get("key_value_seq_lengths"),
                                  q_segment_ids=kw.get("q_segment_ids"), kv_segment_ids=kw.get("kv_segment_ids")))
    dead = ~np.broadcast_to(vis, (q.shape[0], 1, q.shape[1], k.shape[1])).any(-1)[:, 0]  # [B, T]
    if name in ("packed_padding_ids", "segments_lengths", "sinks_lengths_dead_rows"):
        assert dead.any(), "the case should have rows that see no key"
    assert not ours[0][dead].any() and not ours[1][dead].any()


def test_every_option_runs_in_the_kernels(fresh_warnings):
    """Segment ids, sinks and soft-capping together keep the fused kernels (one forward and one backward custom
    call), with no warning about the platform that runs them and nothing of size T x S materialised. (On a GPU
    machine the float32 CPU pass is told, rightly, that the CUDA kernels would not take float32.)"""
    q, k, v, do, kw = _problem(CASES["all_combined"])
    opts = {n: x for n, x in kw.items() if n != "sinks"}
    loss = lambda q, s: jnp.sum(jax_flash.dot_product_attention(q, k, v, sinks=s, **opts))  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(q, kw["sinks"]).as_text()
    other_platform = "on cpu" if ON_GPU else "on cuda"
    assert [str(w.message) for w in caught if other_platform not in str(w.message)] == []
    assert text.count("@jax_flash_fwd") == 1 and text.count("@jax_flash_bwd") == 1
    if not ON_GPU:  # (on GPU the lowering also holds the xla fallback's branch)
        assert f"{q.shape[1]}x{k.shape[1]}x" not in text and f"x{q.shape[1]}x{k.shape[1]}x" not in text


def _expected_metadata(mine, other):
    """{min, max, first, end} per 16-position chunk of mine [L] against other [M] (numpy, directly)."""
    def ranges(ids):
        pad = -len(ids) % 16
        lo = np.pad(ids, (0, pad), constant_values=np.iinfo(np.int32).max).reshape(-1, 16).min(-1)
        hi = np.pad(ids, (0, pad), constant_values=np.iinfo(np.int32).min).reshape(-1, 16).max(-1)
        return lo, hi

    (lo, hi), (olo, ohi) = ranges(mine), ranges(other)
    meets = (lo[:, None] <= ohi[None, :]) & (olo[None, :] <= hi[:, None])
    found = meets.any(-1)
    first = np.where(found, meets.argmax(-1) * 16, np.iinfo(np.int32).max)
    end = np.where(found, np.minimum((len(olo) - meets[:, ::-1].argmax(-1)) * 16, len(other)), 0)
    return np.stack([lo, hi, first, end], -1)


def test_segment_metadata():
    """Per 16-position chunk: the id range, and the hull of the other side's positions whose chunks' id ranges
    meet it (against a direct numpy computation), on ids in any order, packed ones, and a side longer than the
    kernel's staging tile (2048 chunks)."""
    from jax_flash._ffi import segment_operands

    rng = np.random.default_rng(3)
    long_kv = np.sort(rng.integers(0, 40, 40000))
    for q_ids, kv_ids in ((rng.integers(0, 4, (2, 50)), rng.integers(0, 4, (2, 37))),
                          (np.repeat([[1, 2, 3, 7]], [40, 9, 30, 3], axis=1), np.repeat([[0, 2, 3, 9]], 25, axis=1)),
                          (rng.integers(10, 30, (1, 70)), long_kv[None])):
        q_meta, kv_meta, _, _ = (np.asarray(x) for x in segment_operands(jnp.asarray(q_ids, jnp.int32),
                                                                         jnp.asarray(kv_ids, jnp.int32)))
        for b in range(q_ids.shape[0]):
            np.testing.assert_array_equal(q_meta[b], _expected_metadata(q_ids[b], kv_ids[b]))
            np.testing.assert_array_equal(kv_meta[b], _expected_metadata(kv_ids[b], q_ids[b]))


def _expected_runs(mine, other):
    """Each position of mine's id on the other side as [first, last + 1) (an id other lacks: [x, x) at the largest end
    so far), and whether every found id is contiguous there and both bounds never decrease (numpy, directly)."""
    bounds, ok, end = [], True, 0
    for x in mine:
        where = np.flatnonzero(other == x)
        if where.size:  # [first, last + 1), contiguous or not
            ok &= where.size == where[-1] - where[0] + 1
            bounds.append((where[0], where[-1] + 1))
            end = max(end, where[-1] + 1)
        else:  # an id the other side lacks: empty, at the largest end so far
            bounds.append((end, end))
    bounds = np.array(bounds).reshape(-1, 2)
    return bounds, ok and bool((np.diff(bounds, axis=0) >= 0).all())


def _check_runs(q_ids, kv_ids, q_runs, kv_runs):
    """q_runs, kv_runs of one batch element against _expected_runs; returns whether they were taken as runs."""
    from jax_flash._ffi import MAX_SEGMENT_RUNS

    (q_want, q_ok), (kv_want, kv_ok) = _expected_runs(q_ids, kv_ids), _expected_runs(kv_ids, q_ids)
    few = all(1 + np.count_nonzero(np.diff(x)) <= MAX_SEGMENT_RUNS for x in (q_ids, kv_ids))
    if q_ok and kv_ok and few:
        np.testing.assert_array_equal(q_runs, q_want)
        np.testing.assert_array_equal(kv_runs, kv_want)
        return True
    assert (q_runs == -1).all() and (kv_runs == -1).all()
    return False


def test_segment_runs():
    """Each position's run on the other side ([first, last + 1) of the positions holding its id) for the batch
    elements whose ids are runs, and -1 everywhere for the rest, against a direct numpy computation: hand-made cases,
    random packings (whole and in parts), the runs limit, leading dims."""
    from jax_flash._ffi import MAX_SEGMENT_RUNS, segment_operands

    def operands(q_ids, kv_ids):
        return [np.asarray(x) for x in segment_operands(jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32))]

    packed = np.repeat([1, 2, 3, 0], [5, 3, 7, 2])  # documents, then padding (id 0)
    cases = [
        (packed, packed, True),
        (np.repeat([1, 2, 3], [4, 4, 4]), np.repeat([1, 2, 3], [2, 6, 5]), True),  # Sq != Sk, runs on both sides
        (np.repeat([1, 2, 1], [4, 4, 4]), np.repeat([1, 2, 1], [4, 4, 4]), False),  # id 1 in two runs
        (np.repeat([1, 2, 3], [4, 4, 4]), np.repeat([1, 3], [6, 6]), True),  # a row whose id has no key: empty
        (np.repeat([2, 3], [4, 4]), np.repeat([1, 2, 3, 4], [2, 2, 2, 2]), True),  # a part of the sequence (sharding)
        (np.repeat([2, 9, 3], [3, 2, 3]), np.repeat([2, 3], [4, 4]), True),  # an id in the middle missing on kv
        (np.repeat([3, 1, 3], [2, 2, 2]), np.repeat([1], [3]), True),  # an id in two runs, missing on kv: empty
        (np.repeat([1, 2], [4, 4]), np.repeat([2, 5, 1], [3, 2, 3]), False),  # runs present, in other orders
        (np.repeat([1, 2], [4, 4]), np.repeat([2, 1], [4, 4]), False),  # runs in other orders: not monotone
        (np.array([7]), np.array([7, 7, 7]), True),
        (np.arange(MAX_SEGMENT_RUNS), np.arange(MAX_SEGMENT_RUNS), True),  # as many runs as taken
        (np.arange(MAX_SEGMENT_RUNS + 1), np.arange(MAX_SEGMENT_RUNS + 1), False),  # one more: the ids path
    ]
    for q_ids, kv_ids, runs in cases:
        _, _, q_runs, kv_runs = operands(q_ids[None], kv_ids[None])
        assert q_runs.shape == (1, len(q_ids), 2) and kv_runs.shape == (1, len(kv_ids), 2)
        assert _check_runs(q_ids, kv_ids, q_runs[0], kv_runs[0]) == runs, (q_ids, kv_ids)
    # Random packings, whole and in parts (a slice of the query positions against all keys, and the reverse), long
    # enough that each kernel thread holds several positions, and random ids (mostly not runs).
    rng = np.random.default_rng(11)
    taken = 0
    for trial in range(12):
        length = int(rng.integers(1, 5000))
        cuts = np.sort(rng.choice(np.arange(1, length + 1), size=min(int(rng.integers(0, 60)), length), replace=False))
        ids = np.searchsorted(cuts, np.arange(length), side="right") + int(rng.integers(-3, 3))
        if trial % 4 == 3:
            ids = np.where(ids == ids.max(), -7, ids)  # padding id after the documents
        lo, hi = sorted(rng.integers(0, length + 1, 2))
        part = ids[lo:max(hi, lo + 1)]
        for q_ids, kv_ids in ((ids, ids), (part, ids), (ids, part), (rng.integers(0, 3, 40), rng.integers(0, 3, 33))):
            _, _, q_runs, kv_runs = operands(q_ids[None], kv_ids[None])
            taken += _check_runs(q_ids, kv_ids, q_runs[0], kv_runs[0])
        # One array for both sides (kv_segment_ids defaulting to q_segment_ids: one buffer for both operands, which
        # the GPU runs kernel reads once), the same answer as two equal arrays.
        one = jnp.asarray(ids[None], jnp.int32)
        _, _, q_runs, kv_runs = (np.asarray(x) for x in segment_operands(one, one))
        taken += _check_runs(ids, ids, q_runs[0], kv_runs[0])
    assert taken >= 40  # the packings are runs
    # Leading dims: each batch element decides for itself; rank-1 ids (rank-3 inputs) work too.
    two = np.stack([packed, np.where(packed == 0, 1, packed)])  # the second: id 1 twice
    _, _, q_runs, kv_runs = operands(two, two)
    assert [_check_runs(two[b], two[b], q_runs[b], kv_runs[b]) for b in range(2)] == [True, False]
    q_meta, kv_meta, q_runs, kv_runs = operands(packed, packed)
    assert q_runs.shape == (len(packed), 2) and kv_runs.shape == (len(packed), 2) and q_meta.shape == (2, 4)


@pytest.mark.parametrize("h,is_causal,softcap", [(128, True, None), (128, False, 20.0), (64, False, None)],
                         ids=["causal_d128", "capped_d128", "d64"])
def test_mixed_policies_many_tiles_per_cta(h, is_causal, softcap):
    """A batch whose elements take different segment policies (runs and ids) with more forward work units than a
    GPU has SMs, so each persistent CTA steps over the batch elements of the other policy's grid: the same output as
    each batch element alone (bitwise: every tile runs the same code wherever it is scheduled). On sm_90a the causal
    d128 call runs the two-warpgroup grid, the capped d128 and the d64 calls without a mask the 192-row grids, whose
    CTAs move one place on each round (PersistentWalk's skew)."""
    rng = np.random.default_rng(4)
    b, t, n, kh = 8, 1024, 8, 2
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), DTYPE)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kh, h)), DTYPE) for _ in range(2))
    ids = _segments(rng, b, t, "mixed")
    f = jax.jit(lambda q, k, v, ids: jax_flash.dot_product_attention(q, k, v, is_causal=is_causal, q_segment_ids=ids,
                                                                     logits_soft_cap=softcap))
    together = np.asarray(f(q, k, v, ids), np.float32)
    alone = np.concatenate([np.asarray(f(q[i:i + 1], k[i:i + 1], v[i:i + 1], ids[i:i + 1]), np.float32)
                            for i in range(b)])
    np.testing.assert_array_equal(together, alone)


def test_policy_of_batch_elements_past_the_cta_threads():
    """More batch elements than a forward CTA has threads (the sm_90a grids of one segment policy ask one batch
    element per thread whether to run at all), where only the last one takes the ids path and the first the runs:
    every batch element's output equals its call alone."""
    rng = np.random.default_rng(9)
    b, t, n, h = 400, 16, 1, 64
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, h)), DTYPE) for _ in range(3))
    ids = np.repeat(np.repeat([[1, 2]], 8, axis=1), b, axis=0)  # runs
    ids[-1] = np.tile([1, 2], 8)  # id 1 in several runs: not runs, the ids path
    ids = jnp.asarray(ids, jnp.int32)
    f = jax.jit(lambda q, k, v, ids: jax_flash.dot_product_attention(q, k, v, q_segment_ids=ids))
    together = np.asarray(f(q, k, v, ids), np.float32)
    for i in (0, b - 1):
        alone = np.asarray(f(q[i:i + 1], k[i:i + 1], v[i:i + 1], ids[i:i + 1]), np.float32)
        np.testing.assert_array_equal(together[i:i + 1], alone)
    last = [np.asarray(x[-1:], np.float64) for x in (q, k, v)]
    vis = visible_mask(t, t, q_segment_ids=np.asarray(ids[-1:]), kv_segment_ids=np.asarray(ids[-1:]))
    want = numpy_attention_fwd_bwd(*last, np.zeros_like(last[0]), vis)[0]
    np.testing.assert_allclose(together[-1:], want, atol=2e-2 if ON_GPU else 2e-5, rtol=1e-2 if ON_GPU else 2e-5)


def test_no_query_rows():
    """Segment ids with no query rows (Sq = 0): an empty output and zero dK, dV."""
    k = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 2, 32)), DTYPE)
    q = jnp.zeros((2, 0, 2, 32), DTYPE)
    q_ids, kv_ids = jnp.zeros((2, 0), jnp.int32), jnp.asarray([[0, 0, 1, 1, 1], [2, 2, 2, 2, 2]], jnp.int32)

    def loss(q, k, v):
        o = jax_flash.dot_product_attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
        return o.astype(jnp.float32).sum()

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k)
    assert dq.shape == q.shape and not np.asarray(dk, np.float32).any() and not np.asarray(dv, np.float32).any()


def test_segment_operands_transforms():
    """The segment_operands target under vmap (a leading dim added to both) and jit equals the per-element calls;
    ids with mismatched leading dims are refused by the handler with a clear error."""
    from jax_flash._ffi import segment_operands

    rng = np.random.default_rng(5)
    q_ids = jnp.asarray(np.sort(rng.integers(0, 6, (3, 2, 45)), axis=-1), jnp.int32)
    kv_ids = jnp.asarray(np.sort(rng.integers(0, 6, (3, 2, 29)), axis=-1), jnp.int32)
    batched = jax.jit(jax.vmap(segment_operands))(q_ids, kv_ids)
    for i in range(3):
        for got, want in zip(batched, segment_operands(q_ids[i], kv_ids[i])):
            np.testing.assert_array_equal(got[i], want)
    with pytest.raises(Exception, match="same leading dims"):
        jax.block_until_ready(segment_operands(q_ids[0], kv_ids[:, 0]))


@pytest.mark.parametrize("name", ["all_combined", "packed_padding_ids", "sinks_lengths_dead_rows"])
def test_xla_fallback_agrees(name):
    """A platform without a kernel runs a materialised float32 softmax with the same semantics (forward, and the
    backward from o and lse as the kernels compute it)."""
    q, k, v, do, kw = _problem(CASES[name])
    b, t = q.shape[:2]
    lens = (jnp.asarray(kw.get("query_seq_lengths", [t] * b), jnp.int32),
            jnp.asarray(kw.get("key_value_seq_lengths", [k.shape[1]] * b), jnp.int32))
    sinks = kw.get("sinks")
    window = kw["local_window_size"]
    cfgs = [attention_module._Config(scale=0.125, is_causal=kw["is_causal"], window=window, kernel_platforms=p,
                                     softcap=kw.get("logits_soft_cap"), has_sinks=sinks is not None)
            for p in (attention_module._kernel_platforms(q.dtype), ())]

    def run(cfg, q, k, v, sinks):
        return attention_module._flash_attention(cfg, q, k, v, *lens, kw.get("q_segment_ids"),
                                                 kw.get("kv_segment_ids"), sinks)

    results = []
    for cfg in cfgs:
        (o, lse), vjp = jax.vjp(lambda q, k, v, s: run(cfg, q, k, v, s), q, k, v, sinks)
        grads = vjp((do.astype(o.dtype), jnp.zeros_like(lse)))
        results.append([o, lse, *(g for g in grads if g is not None)])
    for x, y in zip(*results):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(x, y, atol=5e-2 if ON_GPU else 2e-5, rtol=2e-2 if ON_GPU else 2e-5)


@pytest.mark.parametrize("name", ["sinks_lengths_dead_rows", "all_combined", "softcap_long_saturated_d128"])
def test_residual_is_the_sink_inclusive_lse(name):
    q, k, v, _, kw = _problem(CASES[name])
    _, lse = jax_flash.dot_product_attention(q, k, v, return_residual=True, **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, ref = attention_with_lse(*f32, **{n: x for n, x in kw.items() if x is not None})
    ref = np.swapaxes(np.asarray(ref), -1, -2)  # [B, T, N]
    np.testing.assert_allclose(np.asarray(lse, np.float32), ref, atol=2e-2 if ON_GPU else 1e-5, rtol=1e-2)
    if name == "sinks_lengths_dead_rows":  # batch row 2 has no keys: the sink alone
        np.testing.assert_allclose(np.asarray(lse[2], np.float32), np.broadcast_to(kw["sinks"], lse[2].shape),
                                   rtol=1e-2)


def _normal_inputs(seed, dtype, head_dim, t, s, q_amp=1.0):
    """(q, k, v, do) of standard normal values (q times q_amp) in dtype: batch 2, 4 query heads on 2 kv heads."""
    rng = np.random.default_rng(seed)
    b, n, kh = 2, 4, 2
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32) * amp, dtype)
                 for shape, amp in (((b, t, n, head_dim), q_amp), ((b, s, kh, head_dim), 1.0),
                                    ((b, s, kh, head_dim), 1.0), ((b, t, n, head_dim), 1.0)))


@pytest.mark.parametrize("cap,head_dim,causal", [(20.0, 128, True), (50.0, 128, False), (5.0, 64, True)])
def test_soft_cap_in_float16(cap, head_dim, causal):
    """float16 inputs with a soft cap against the float64 reference, forward and gradients. At c = 20 and 50 logits
    far below the cap (standard normal q and k) put a fixed reference's exponentials (2^-(A + R), 2^-57.7 at c = 20)
    below float16's range, where P would be flushed to 0 (the sm_90a forward keeps the running maximum for float16);
    c = 5 (d64) stays within it and covers the capped float16 backward's dS^T factor."""
    q, k, v, do = _normal_inputs(3, jnp.float16, head_dim, t=200, s=330)
    kw = dict(is_causal=causal, local_window_size=None, logits_soft_cap=cap)
    ref = _reference64(q, k, v, do, kw)
    ours = _fwd_bwd(jax_flash.dot_product_attention, q, k, v, do, kw)
    base = _fwd_bwd(_baseline, q, k, v, do, kw)
    _assert_near_reference(f"c={cap} d{head_dim}", ours, base, ref, jnp.float16)


@pytest.mark.parametrize("cap,head_dim,causal", [(50.0, 128, True), (0.05, 128, False), (20.0, 64, False)])
def test_soft_cap_with_deterministic_backward(cap, head_dim, causal, attention_checks):
    """A soft cap with deterministic=True (the sm_90a backward's ordered dQ additions) against the float64 reference,
    bit for bit equal over two runs; c = 0.05 lies below the softmax scale (the tanh's argument pre * q.k with
    pre = scale / c > 1; q is scaled by min(c, 1) so the tanh works in its curved range)."""
    if not ON_GPU or not attention_checks.sm90_backward_available():
        pytest.skip("deterministic=True needs the sm_90a backward")
    q, k, v, do = _normal_inputs(5, DTYPE, head_dim, t=300, s=530, q_amp=min(cap, 1.0))
    kw = dict(is_causal=causal, local_window_size=None, logits_soft_cap=cap)
    deterministic = functools.partial(jax_flash.dot_product_attention, deterministic=True)
    runs = [_fwd_bwd(deterministic, q, k, v, do, kw) for _ in range(2)]
    for x, y in zip(*runs):
        np.testing.assert_array_equal(x, y)
    _assert_near_reference(f"c={cap} d{head_dim}", runs[0], _fwd_bwd(_baseline, q, k, v, do, kw),
                           _reference64(q, k, v, do, kw), DTYPE)


def test_soft_cap_keeps_nan_in_its_row():
    """A nan in one query row makes exactly that row's output nan with a soft cap, also over key tiles that every
    row sees (the kernels' unmasked steps)."""
    q, k, v, _, kw = _problem(CASES["softcap_long_noncausal_d128"])
    q = q.at[0, 100, 1, 3].set(jnp.nan)
    bad = ~np.isfinite(np.asarray(jax_flash.dot_product_attention(q, k, v, **kw), np.float32))
    assert bad[0, 100, 1].all()
    bad[0, 100, 1] = False
    assert not bad.any()


def test_soft_cap_keeps_nan_in_its_gradients():
    """The same nan's gradients are non-finite exactly where the materialised reference's are (the capped backward
    computes part of its exponentials on the FMA pipe, which must keep a nan)."""
    q, k, v, do, kw = _problem(CASES["softcap_long_noncausal_d128"])
    q = q.at[0, 100, 1, 3].set(jnp.nan)

    def bad(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v, **kw).astype(jnp.float32) * do)  # noqa: E731
        return [~np.isfinite(np.asarray(g, np.float32)) for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)]

    ours, base = bad(jax_flash.dot_product_attention), bad(_baseline)
    for label, x, b in zip(("dq", "dk", "dv"), ours, base):
        assert b.any(), f"{label}: the reference should have non-finite entries"
        np.testing.assert_array_equal(x, b, err_msg=label)


def test_transformations():
    """vmap over a leading axis (segment ids and lengths mapped too), checkpoint, rank-3 inputs with (T,) ids."""
    q, k, v, do, kw = _problem(CASES["all_combined"])

    def attn(q, k, v, qs, ks, sinks):
        return jax_flash.dot_product_attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks, sinks=sinks,
                                               is_causal=True, logits_soft_cap=5.0)

    full = attn(q, k, v, kw["q_segment_ids"], kw["kv_segment_ids"], kw["sinks"])
    mapped = jax.vmap(attn, in_axes=(0, 0, 0, 0, 0, None))(
        q[:, None], k[:, None], v[:, None], kw["q_segment_ids"][:, None], kw["kv_segment_ids"][:, None], kw["sinks"])
    np.testing.assert_allclose(np.asarray(mapped[:, 0], np.float32), np.asarray(full, np.float32), atol=1e-6)
    rank3 = attn(q[1], k[1], v[1], kw["q_segment_ids"][1], kw["kv_segment_ids"][1], kw["sinks"])
    np.testing.assert_allclose(np.asarray(rank3, np.float32), np.asarray(full[1], np.float32), atol=1e-6)
    loss = lambda *a: jnp.sum(attn(*a).astype(jnp.float32) * do)  # noqa: E731
    args = (q, k, v, kw["q_segment_ids"], kw["kv_segment_ids"], kw["sinks"])
    g1 = jax.grad(loss, argnums=(0, 5))(*args)
    g2 = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 5)))(*args)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5, rtol=1e-5)
    sinks_grad = jax.jit(jax.grad(lambda s: jnp.sum(jax_flash.dot_product_attention(q, k, v, sinks=s))))(kw["sinks"])
    assert sinks_grad.shape == kw["sinks"].shape and np.isfinite(np.asarray(sinks_grad)).all()


def test_kv_segment_ids_default_to_q_segment_ids():
    q, k, v, _, kw = _problem(CASES["packed_causal_gqa"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = jax_flash.dot_product_attention(q, k, v, q_segment_ids=kw["q_segment_ids"], is_causal=True)
        b = jax_flash.dot_product_attention(q, k, v, q_segment_ids=kw["q_segment_ids"],
                                            kv_segment_ids=kw["q_segment_ids"], is_causal=True)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


BAD = {
    "ids_dtype": (dict(q_segment_ids=np.zeros((2, 8), np.int64)), TypeError, "q_segment_ids must be int32, got int64"),
    "ids_shape": (dict(q_segment_ids=np.zeros((2, 7), np.int32)), ValueError, "q_segment_ids must have shape (2, 8)"),
    "kv_ids_shape": (dict(q_segment_ids=np.zeros((2, 8), np.int32), kv_segment_ids=np.zeros((8,), np.int32)),
                     ValueError, "kv_segment_ids must have shape (2, 8)"),
    "kv_ids_alone": (dict(kv_segment_ids=np.zeros((2, 8), np.int32)), ValueError, "kv_segment_ids needs"),
    "sinks_dtype": (dict(sinks=np.zeros(4, np.float16)), TypeError, "sinks must be float32, got float16"),
    "sinks_shape": (dict(sinks=np.zeros(2, np.float32)), ValueError, "sinks must have shape (num_query_heads,) = (4,)"),
    "sinks_inf": (dict(sinks=np.array([0, np.inf, 0, 0], np.float32)), ValueError, "sinks must be finite"),
    "sinks_nan": (dict(sinks=np.array([0, 0, np.nan, 0], np.float32)), ValueError, "sinks must be finite"),
    "sinks_huge": (dict(sinks=np.array([0, 0, 3e38, 0], np.float32)), ValueError, "log2(e) must fit a float32"),
    "cap_zero": (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be finite and > 0, got 0.0"),
    "cap_negative": (dict(logits_soft_cap=-1), ValueError, "finite and > 0, got -1.0"),
    "cap_inf": (dict(logits_soft_cap=float("inf")), ValueError, "finite and > 0, got inf"),
    "cap_nan": (dict(logits_soft_cap=float("nan")), ValueError, "finite and > 0, got nan"),
    "cap_type": (dict(logits_soft_cap="5"), TypeError, "logits_soft_cap must be None or a static Python float"),
    # float32 subnormal (the CPU's threads would read it as 0, no cap), past float32, scale / cap subnormal
    "cap_subnormal": (dict(logits_soft_cap=1e-40), ValueError, "logits_soft_cap must be a normal float32"),
    "cap_past_float32": (dict(logits_soft_cap=1e39), ValueError, "logits_soft_cap must be a normal float32"),
    "cap_over_scale": (dict(logits_soft_cap=1e38), ValueError, "scale / logits_soft_cap and logits_soft_cap / scale"),
    "cap_under_scale": (dict(logits_soft_cap=1e-37, scale=1e3), ValueError, "got logits_soft_cap=1e-37 with scale"),
    "cap_with_xla": (dict(logits_soft_cap=5.0, implementation="xla"), ValueError, "implementation='xla'"),
    "sinks_with_mask": (dict(sinks=np.zeros(4, np.float32), mask=np.ones((8, 8), bool)), ValueError,
                        "dense bias or mask"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_arguments(name):
    kw, error, message = BAD[name]
    q = jnp.zeros((2, 8, 4, 32), DTYPE)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        jax_flash.dot_product_attention(q, q[:, :, :2], q[:, :, :2], **kw)


def test_kv_segment_ids_required_when_lengths_differ():
    q, k = jnp.zeros((2, 8, 4, 32), DTYPE), jnp.zeros((2, 12, 4, 32), DTYPE)
    with pytest.raises(ValueError, match="kv_segment_ids is required when the query and key/value lengths differ"):
        jax_flash.dot_product_attention(q, k, k, q_segment_ids=jnp.zeros((2, 8), jnp.int32))


def test_traced_soft_cap_is_refused():
    q = jnp.zeros((1, 8, 2, 32), DTYPE)
    with pytest.raises(TypeError, match="static Python float"):
        jax.jit(lambda c: jax_flash.dot_product_attention(q, q, q, logits_soft_cap=c))(5.0)
