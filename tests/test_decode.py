"""jax_flash.decode_attention and combine against a float64 reference: dense and paged caches, ragged lengths
(1 and the full cache included), GQA and MQA, Tq > 1 with the bottom-right causal mask, windows, soft cap and sinks,
num_splits, one length for a batch (kv_lengths of shape ()) and its split plan, combine over parts of a cache;
validation; forward only; batch- and head-sharded calls (8 fake CPU devices in a subprocess). float32 on the CPU and,
where a GPU is visible, bfloat16 on it (the CUDA decode kernels)."""

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.reference import numpy_attention_fwd_bwd

# Every test runs on the CPU (float32) and, where the CUDA kernels can run, on the GPU (bfloat16): conftest's
# each_platform sets the default device and these module values for each.
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("each_platform")]
PLATFORM_VALUES = {"ON_GPU": (False, True), "DTYPE": (jnp.float32, jnp.bfloat16), "TOL": (2e-5, 3e-2)}
ON_GPU = False
DTYPE = jnp.float32
TOL = 2e-5


def _reference(q, k, v, lengths, *, is_causal=True, window=None, sinks=None, softcap=None):
    """float64 (out, lse [B, Tq, Hq]) of each sequence's rows at positions length - Tq + t over its first keys."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, rows, hq, d = q.shape
    outs, lses = [], []
    for i in range(b):
        n = int(lengths[i])
        keys = min(max(n, 1), k.shape[1])  # keys at or past n are never seen: the reference reads the first `keys`
        pos = n - rows + np.arange(rows)[:, None]
        j = np.arange(keys)[None, :]
        vis = np.broadcast_to(j < n, (rows, keys)).copy()
        if is_causal:
            vis &= j <= pos
        if window is not None:
            vis &= (j >= pos - window[0]) & (j <= pos + window[1])
        vis = vis[None, None]
        o = numpy_attention_fwd_bwd(q[i:i + 1], k[i:i + 1, :keys], v[i:i + 1, :keys], np.zeros_like(q[i:i + 1]), vis,
                                    sinks=sinks, logits_soft_cap=softcap)[0]
        outs.append(o[0])
        # lse from the same logits
        group = hq // k.shape[2]
        kr = np.repeat(k[i, :keys], group, axis=1)
        logits = np.einsum("tnh,snh->nts", q[i], kr) / np.sqrt(d)
        if softcap is not None:
            logits = softcap * np.tanh(logits / softcap)
        logits = np.where(vis[0], logits, -np.inf)
        m = logits.max(-1, keepdims=True)
        if sinks is not None:
            m = np.maximum(m, np.asarray(sinks, np.float64)[:, None, None])
        m = np.where(np.isfinite(m), m, 0)
        tot = np.exp(logits - m).sum(-1) + (0 if sinks is None else np.exp(np.asarray(sinks)[:, None] - m[..., 0]))
        with np.errstate(divide="ignore"):
            lses.append(np.swapaxes(np.log(tot) + m[..., 0], 0, 1))
    return np.stack(outs), np.stack(lses)


def _cache(rng, batch, capacity, hkv, d, page_size=None):
    """(dense k, v [B, capacity, Hkv, D], and for a paged layout the pages, a shuffled page table)."""
    k, v = (rng.standard_normal((batch, capacity, hkv, d)).astype(np.float32) for _ in range(2))
    if page_size is None:
        return k, v, None, None, None
    per = capacity // page_size
    perm = rng.permutation(batch * per + 3)[:batch * per]  # a few spare pages, in no order
    table = perm.reshape(batch, per).astype(np.int32)
    pages_k = np.zeros((batch * per + 3, page_size, hkv, d), np.float32)
    pages_v = np.zeros_like(pages_k)
    for b in range(batch):
        for j in range(per):
            pages_k[table[b, j]] = k[b, j * page_size:(j + 1) * page_size]
            pages_v[table[b, j]] = v[b, j * page_size:(j + 1) * page_size]
    return k, v, pages_k, pages_v, table


CASES = {
    "dense_gqa_t1": dict(batch=3, rows=1, hq=8, hkv=2, d=64, capacity=96, lengths=(96, 1, 45)),
    "dense_mqa_t4": dict(batch=2, rows=4, hq=4, hkv=1, d=128, capacity=80, lengths=(80, 3)),
    "paged16_t16_ragged": dict(batch=3, rows=16, hq=4, hkv=2, d=64, capacity=128, lengths=(128, 17, 5),
                               page_size=16),
    "paged64_window": dict(batch=2, rows=2, hq=2, hkv=2, d=64, capacity=192, lengths=(150, 192), page_size=64,
                           window=(40, 0)),
    "noncausal_softcap_sinks": dict(batch=2, rows=3, hq=4, hkv=2, d=32, capacity=64, lengths=(64, 20),
                                    is_causal=False, softcap=5.0, sinks=True),
    # non-causal windows: a right side past the last row (the kernels' unbounded side) and one inside the rows
    "noncausal_window_right_past_rows": dict(batch=2, rows=3, hq=4, hkv=2, d=32, capacity=64, lengths=(64, 20),
                                             is_causal=False, window=(10, 7)),
    "noncausal_window_right_inside_rows": dict(batch=2, rows=3, hq=4, hkv=2, d=32, capacity=64, lengths=(64, 20),
                                               is_causal=False, window=(10, 1)),
    "paged_d256_sinks": dict(batch=1, rows=5, hq=2, hkv=1, d=256, capacity=64, lengths=(33,), page_size=16,
                             sinks=True),
    # kv_lengths as one scalar (every sequence equally long: the split plan for equal lengths): split over few
    # (sequence, kv head) pairs, one split each over many, Tq > 1 with a window, soft cap and sinks, a paged cache of
    # 128 packed rows, nothing to see (length 0)
    "one_length_b16": dict(batch=16, rows=1, hq=8, hkv=2, d=64, capacity=600, lengths=(577,) * 16, one_length=True),
    "one_length_b70_one_split": dict(batch=70, rows=1, hq=4, hkv=2, d=64, capacity=300, lengths=(300,) * 70,
                                     one_length=True),
    "one_length_t4_window_softcap_sinks": dict(batch=3, rows=4, hq=8, hkv=2, d=128, capacity=700,
                                               lengths=(650,) * 3, window=(200, 0), softcap=8.0, sinks=True,
                                               one_length=True),
    "one_length_paged16_rows128": dict(batch=4, rows=16, hq=8, hkv=1, d=128, capacity=256, lengths=(200,) * 4,
                                       page_size=16, one_length=True),
    "one_length_zero": dict(batch=2, rows=1, hq=4, hkv=2, d=32, capacity=64, lengths=(0, 0), one_length=True),
}


def _case(name):
    return CASES[name] if name in CASES else KERNEL_CASES[name]


def _run(case, num_splits=None, seed=0):
    rng = np.random.default_rng(seed)
    b, rows, hq, hkv, d, cap = (case[x] for x in ("batch", "rows", "hq", "hkv", "d", "capacity"))
    q = rng.standard_normal((b, rows, hq, d)).astype(np.float32)
    k, v, pk, pv, table = _cache(rng, b, cap, hkv, d, case.get("page_size"))
    sinks = rng.standard_normal(hq).astype(np.float32) if case.get("sinks") else None
    lengths = np.asarray(case["lengths"], np.int32)
    given = jnp.asarray(lengths[0] if case.get("one_length") else lengths)  # one length: () for the whole batch
    kw = dict(is_causal=case.get("is_causal", True), local_window_size=case.get("window"),
              logits_soft_cap=case.get("softcap"), sinks=None if sinks is None else jnp.asarray(sinks),
              num_splits=case.get("splits") if num_splits is None else num_splits, return_residual=True)
    cast = lambda x: jnp.asarray(x, DTYPE)  # noqa: E731
    if table is None:
        out, lse = jax.jit(lambda q, k, v, n: jax_flash.decode_attention(q, k, v, n, **kw))(
            cast(q), cast(k), cast(v), given)
    else:
        out, lse = jax.jit(lambda q, k, v, n, t: jax_flash.decode_attention(q, k, v, n, page_table=t, **kw))(
            cast(q), cast(pk), cast(pv), given, jnp.asarray(table))
    q16, k16, v16 = (np.asarray(cast(x), np.float64) for x in (q, k, v))
    ref = _reference(q16, k16, v16, lengths, is_causal=kw["is_causal"], window=case.get("window"), sinks=sinks,
                     softcap=case.get("softcap"))
    return np.asarray(out, np.float64), np.asarray(lse, np.float64), ref


def _assert_matches(out, lse, ref_o, ref_lse):
    """A call's (out, lse) against _run's float64 reference: within TOL, and lse -inf where no key is seen."""
    np.testing.assert_allclose(out, ref_o, atol=TOL, rtol=TOL)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=TOL, rtol=TOL)
    assert (lse[~finite] == -np.inf).all()


# Shapes for the decode kernels' variants on a GPU (the mma.sync kernel's 1, 2, 4 and 8 row tiles; on compute
# capability 9.0 the wgmma kernel past 32 packed rows at head dims up to 128, one and two warpgroups; padded
# head dims; many splits), and one past 128 packed rows (the attention kernel runs, with a warning).
KERNEL_CASES = {
    "rows32_ragged": dict(batch=2, rows=4, hq=16, hkv=2, d=128, capacity=1000, lengths=(1000, 333)),
    "rows24_noncausal": dict(batch=3, rows=3, hq=8, hkv=1, d=128, capacity=1000, lengths=(1000, 640, 64),
                             is_causal=False),
    "rows64_d64_softcap_sinks": dict(batch=2, rows=8, hq=16, hkv=2, d=64, capacity=500, lengths=(500, 77),
                                     softcap=10.0, sinks=True),
    "rows96_d80_paged16": dict(batch=2, rows=12, hq=8, hkv=1, d=80, capacity=320, lengths=(320, 1), page_size=16),
    # ragged batches that test_balanced_splits_match_reference runs with balanced splits (decode_split_plan's
    # choice for few long splits), on the wgmma kernel on an H100/H200
    "rows64_d64_balanced": dict(batch=3, rows=8, hq=16, hkv=2, d=64, capacity=4096, lengths=(4096, 1, 2500)),
    "rows64_paged16_balanced": dict(batch=3, rows=16, hq=8, hkv=2, d=128, capacity=4096, lengths=(4096, 3000, 17),
                                    page_size=16, window=(1000, 0)),
    # balanced splits (test_balanced_splits_match_reference) over batches with sequences of no key, whose splits
    # are all empty, on the mma.sync kernel and (48 packed rows) the wgmma one; and at equal lengths (half of the
    # balanced grid's splits empty)
    "balanced_zero_lengths_b10": dict(batch=10, rows=2, hq=8, hkv=2, d=64, capacity=1500,
                                      lengths=(1500, 0, 0, 1, 1499, 0, 700, 64, 65, 0)),
    "balanced_equal_b16": dict(batch=16, rows=1, hq=8, hkv=1, d=128, capacity=2048, lengths=(2048,) * 16),
    "rows48_balanced_zero_lengths": dict(batch=6, rows=6, hq=8, hkv=1, d=128, capacity=2000,
                                         lengths=(2000, 0, 333, 0, 1999, 1), sinks=True),
    "rows64_d256": dict(batch=1, rows=8, hq=8, hkv=1, d=256, capacity=300, lengths=(300,), is_causal=False),
    "rows128_paged64_window": dict(batch=2, rows=16, hq=8, hkv=1, d=128, capacity=704, lengths=(700, 64),
                                   page_size=64, window=(100, 0)),
    "d96": dict(batch=2, rows=2, hq=4, hkv=4, d=96, capacity=130, lengths=(129, 2)),
    "d40_softcap_sinks": dict(batch=2, rows=1, hq=6, hkv=3, d=40, capacity=77, lengths=(77, 9), softcap=20.0,
                              sinks=True),
    "long_one_sequence": dict(batch=1, rows=1, hq=32, hkv=8, d=128, capacity=20000, lengths=(19999,)),
    # few rows of many splits: the combine's block kernel spreads each row's columns over several blocks (8 rows of
    # ~156 splits at d128: 4 chunks; at d80, 20 float4 columns: 2 chunks of 10)
    "combine_chunks_rows8": dict(batch=1, rows=1, hq=8, hkv=1, d=128, capacity=20000, lengths=(19990,), sinks=True),
    "combine_chunks_d80": dict(batch=1, rows=2, hq=4, hkv=1, d=80, capacity=16000, lengths=(15999,), softcap=25.0),
    # rows that see no key (kv_length 2 < Tq 4) over many splits: the no-key output of every column chunk
    "combine_chunks_no_key": dict(batch=1, rows=4, hq=4, hkv=1, d=128, capacity=20000, lengths=(2,), sinks=True),
    "paged16_long_ragged": dict(batch=3, rows=2, hq=8, hkv=2, d=64, capacity=4096, lengths=(4096, 1, 2500),
                                page_size=16),
    "rows256_falls_back": dict(batch=1, rows=16, hq=16, hkv=1, d=64, capacity=64, lengths=(40,)),
    # the kernels' paged + soft-cap variants with padding rows (24 padding rows in a 64-row block: 40 packed rows;
    # 12 in a 16-row tile: 4 packed rows) and tiles that every row sees beside windowed and causal ones; the wgmma
    # kernel's 4-stage ring (d64) paged and capped, and its d128 dense capped variant
    "rows40_paged16_softcap_window": dict(batch=2, rows=5, hq=8, hkv=1, d=128, capacity=1024, lengths=(1000, 300),
                                          page_size=16, window=(200, 0), softcap=15.0),
    "paged16_t1_softcap": dict(batch=2, rows=1, hq=8, hkv=2, d=128, capacity=512, lengths=(512, 77), page_size=16,
                               softcap=30.0),
    "rows48_d64_paged16_softcap": dict(batch=3, rows=6, hq=8, hkv=1, d=64, capacity=2048, lengths=(2048, 700, 130),
                                       page_size=16, softcap=8.0),
    "rows64_d128_softcap": dict(batch=2, rows=8, hq=16, hkv=2, d=128, capacity=900, lengths=(900, 500),
                                softcap=25.0),
    # 1024 output rows (B x Tq x Hq): split calls of up to 64 splits take the warp-per-row combine (24 float4
    # columns at d96: lanes without a column)
    "rows1024_d96_softcap_sinks": dict(batch=8, rows=16, hq=8, hkv=1, d=96, capacity=300,
                                       lengths=(300, 1, 150, 77, 299, 64, 65, 200), softcap=18.0, sinks=True),
    # the wgmma kernel's two warpgroups: d64 (5-stage ring) paged, capped, with sinks and 48 padding rows; d128
    # (6 stages) capped over a ragged batch (balanced splits, a sequence of one key)
    "rows80_d64_paged16_softcap_sinks": dict(batch=2, rows=10, hq=8, hkv=1, d=64, capacity=2000, lengths=(2000, 450),
                                             page_size=16, softcap=12.0, sinks=True),
    "rows128_softcap_ragged": dict(batch=3, rows=16, hq=8, hkv=1, d=128, capacity=3000, lengths=(3000, 1, 1777),
                                   softcap=20.0),
    # the TMA kernel (65-128 packed rows on an H100/H200; dense caches here): 56 padding rows at d64 with a window
    # (keys below it in the range's first 128-key tile) and sinks; a padded head dim (d96: a column block past it)
    # over a ragged batch with sequences of 1, 128 and 129 keys (tiles that end at the range and past it; one split
    # each, longest first); 6 query heads per kv head (96 rows) capped; 5 per kv head x 13 steps (65 rows: a group
    # that is no power of two, a partial 8-row swizzle block); one long sequence over many splits; sequences shorter
    # than Tq
    "rows72_d64_window_sinks": dict(batch=2, rows=9, hq=8, hkv=1, d=64, capacity=1000, lengths=(999, 130),
                                    window=(300, 0), sinks=True),
    "rows112_d96_noncausal_b5": dict(batch=5, rows=14, hq=8, hkv=1, d=96, capacity=777,
                                     lengths=(777, 1, 128, 129, 500), is_causal=False),
    "rows96_g6_softcap": dict(batch=2, rows=16, hq=12, hkv=2, d=128, capacity=2000, lengths=(2000, 1500),
                              softcap=20.0),
    "rows65_g5_window": dict(batch=2, rows=13, hq=10, hkv=2, d=128, capacity=1500, lengths=(1500, 700),
                             window=(400, 0)),
    "rows128_long_one_sequence": dict(batch=1, rows=16, hq=16, hkv=2, d=128, capacity=20000, lengths=(19999,)),
    "rows128_short_sequences": dict(batch=2, rows=16, hq=8, hkv=1, d=128, capacity=300, lengths=(5, 300)),
    # one split a sequence in batch order (a grid of at most one wave of the TMA kernel's 132 CTAs on an H100/H200
    # SXM, of up to 64 sequences too, or one sequence; decode::RankBatch): the TMA kernel loads Q and tile 0 before it
    # reads the length, so sequences of 0, 1, 127-129 keys and a cache shorter than the tile (TMA zero-fills past its
    # end) meet keys past the range in that early tile; two kv heads over 65 sequences (the unit's kv head and
    # sequence from its grid index); capped with sinks at d64; non-causal
    "rows128_early_tile_b40": dict(batch=40, rows=16, hq=8, hkv=1, d=128, capacity=300, splits=1,
                                   lengths=tuple((0, 1, 129, 300)[i % 4] if i < 8 else 1 + (i * 53) % 300
                                                 for i in range(40))),
    "rows128_early_tile_b70": dict(batch=70, rows=16, hq=8, hkv=1, d=128, capacity=300, splits=1,
                                   lengths=tuple((0, 1, 127, 128, 129, 300)[i % 6] if i < 12 else 1 + (i * 41) % 300
                                                 for i in range(70))),
    "rows128_early_tile_b65_hkv2": dict(batch=65, rows=8, hq=32, hkv=2, d=128, capacity=200, splits=1,
                                        lengths=tuple(0 if i == 3 else 1 + (i * 53) % 200 for i in range(65))),
    "rows72_d64_early_tile_short_cache": dict(batch=1, rows=9, hq=8, hkv=1, d=64, capacity=100, lengths=(77,),
                                              splits=1, softcap=12.0, sinks=True),
    "rows96_early_tile_noncausal": dict(batch=1, rows=16, hq=12, hkv=2, d=128, capacity=1000, lengths=(999,),
                                        splits=1, is_causal=False),
    # paged caches of 72-128 packed rows (the TMA kernel's cp.async gather on an H100/H200): pages longer than its
    # 128-key tile (two tiles a page, a window) and of 48 keys (no power of two)
    "rows72_d64_paged256_window": dict(batch=2, rows=9, hq=8, hkv=1, d=64, capacity=1024, lengths=(1000, 300),
                                       page_size=256, window=(300, 0)),
    "rows128_paged48": dict(batch=2, rows=16, hq=8, hkv=1, d=128, capacity=960, lengths=(960, 333), page_size=48),
    # pages of 12 keys (no multiple of 8: the TMA kernel's gather looks each key up) with a window, also at a
    # padded head dim; of 4 (a power of two below the 8 keys a gather thread copies) and of 8 (the smallest that
    # share one lookup) with a window
    "rows128_paged12_window": dict(batch=2, rows=16, hq=8, hkv=1, d=128, capacity=300, lengths=(300, 77),
                                   page_size=12, window=(100, 0)),
    "rows96_d80_paged12": dict(batch=2, rows=12, hq=8, hkv=1, d=80, capacity=240, lengths=(240, 131), page_size=12),
    "rows128_paged4": dict(batch=2, rows=16, hq=8, hkv=1, d=128, capacity=200, lengths=(200, 59), page_size=4),
    "rows128_paged8_window": dict(batch=2, rows=16, hq=8, hkv=1, d=128, capacity=400, lengths=(400, 203),
                                  page_size=8, window=(150, 0)),
    # more of the TMA kernel's units (CTAs) than the GPU runs at once: one split per sequence of a ragged batch
    # taken longest first (48 x 4 units, sequences of 1 to 200 keys, some shorter than Tq), a paged batch of 80 x 2
    # units and dense ones of 200 x 1 and 100 x 2 (past 64 sequences, ranked as grids of a few waves:
    # decode::RankBatch; 200 sequences of at most 3 tiles, each its own bucket, and 100 of up to 36 tiles, most of
    # them short, several a bucket of the ranking: the float64 reference of 100 x 16 rows of 6000 keys took minutes
    # on the GPU host), and balanced splits over a ragged batch at d64 (40 sequences x 6 splits, half of them empty,
    # ranked too)
    "rows128_units_ranked_b48": dict(batch=48, rows=16, hq=32, hkv=4, d=128, capacity=200,
                                     lengths=tuple(1 + (i * 37) % 200 for i in range(48))),
    "rows128_units_paged16_b80": dict(batch=80, rows=16, hq=16, hkv=2, d=128, capacity=160, page_size=16,
                                      lengths=tuple(160 - (i * 23) % 160 for i in range(80))),
    "rows128_units_ranked_b200": dict(batch=200, rows=16, hq=8, hkv=1, d=128, capacity=300,
                                      lengths=tuple((0, 1, 300)[i % 3] if i < 9 else 1 + (i * 67) % 300
                                                    for i in range(200))),
    "rows72_units_ranked_b100_buckets": dict(batch=100, rows=9, hq=16, hkv=2, d=128, capacity=4500, splits=1,
                                             lengths=tuple(1 + (i * 613) % 4500 if i % 4 == 0 else 1 + (i * 37) % 600
                                                           for i in range(100))),
    "rows72_d64_units_balanced_b40": dict(batch=40, rows=9, hq=8, hkv=1, d=64, capacity=2000,
                                          lengths=tuple(2000 - (i * 331) % 1990 for i in range(40))),
    # more than four waves of the TMA kernel's units, unranked (past 256 sequences, or split): its persistent grid on
    # an H100/H200 (132 CTAs taking units from the work counter; DecodeTmaGrid): 300 x 2 units of one split, some
    # sequences without keys (empty units among the others), dense and paged; and 40 sequences x 16 equal splits at
    # d64, the short sequences' later splits empty
    "rows128_persistent_b300": dict(batch=300, rows=16, hq=16, hkv=2, d=128, capacity=200, splits=1,
                                    lengths=tuple((0, 1, 200)[i % 3] if i < 9 else 1 + (i * 53) % 200
                                                  for i in range(300))),
    "rows128_persistent_paged16_b300": dict(batch=300, rows=16, hq=16, hkv=2, d=128, capacity=192, splits=1,
                                            page_size=16,
                                            lengths=tuple((0, 1, 192)[i % 3] if i < 9 else 1 + (i * 53) % 192
                                                          for i in range(300))),
    "rows72_d64_persistent_splits16_b40": dict(batch=40, rows=9, hq=8, hkv=1, d=64, capacity=4000, splits=16,
                                               lengths=tuple(1 + (i * 977) % 4000 for i in range(40))),
    # one split per sequence (a capacity under 256 keys): ragged batches whose blocks take the sequences longest
    # first (ties in batch order; the mma.sync kernel, and the wgmma one at 64 packed rows; up to 64 sequences, the
    # longest-first limit), and larger ones, which keep the batch order (kernels under 384 threads rank at most 64)
    "one_split_ragged_b40": dict(batch=40, rows=1, hq=4, hkv=2, d=64, capacity=200,
                                 lengths=tuple(1 + (i * 7) % 13 * 15 for i in range(40))),
    "one_split_rows64_ragged_b24": dict(batch=24, rows=8, hq=16, hkv=2, d=128, capacity=250,
                                        lengths=tuple(250 - (i * 11) % 9 * 25 for i in range(24))),
    "one_split_equal_b5": dict(batch=5, rows=2, hq=8, hkv=2, d=128, capacity=160, lengths=(150,) * 5),
    "one_split_ragged_b64": dict(batch=64, rows=1, hq=4, hkv=1, d=64, capacity=120,
                                 lengths=tuple(120 - (i * 37) % 119 for i in range(64))),
    "one_split_ragged_b65": dict(batch=65, rows=1, hq=4, hkv=1, d=64, capacity=120,
                                 lengths=tuple(1 + (i * 29) % 120 for i in range(65))),
    "one_split_ragged_b300": dict(batch=300, rows=1, hq=2, hkv=1, d=64, capacity=64,
                                  lengths=tuple(1 + (i * 5) % 64 for i in range(300))),
}


@pytest.mark.parametrize("name", list(CASES) + list(KERNEL_CASES))
def test_matches_float64_reference(name, fresh_warnings):
    if name == "rows256_falls_back" and ON_GPU:
        with pytest.warns(RuntimeWarning, match="packs at most 128 query rows"):
            out, lse, (ref_o, ref_lse) = _run(_case(name))
    else:
        out, lse, (ref_o, ref_lse) = _run(_case(name))
    _assert_matches(out, lse, ref_o, ref_lse)


MANY_ROWS = ["paged16_t16_ragged", "rows32_ragged", "rows24_noncausal", "rows64_d64_softcap_sinks",
             "rows96_d80_paged16", "rows128_paged64_window", "rows64_paged16_balanced",
             "rows40_paged16_softcap_window", "rows48_d64_paged16_softcap",
             "rows80_d64_paged16_softcap_sinks", "rows128_softcap_ragged"]


TMA_ROWS = ["rows128_softcap_ragged", "rows72_d64_window_sinks", "rows112_d96_noncausal_b5", "rows96_g6_softcap",
            "rows65_g5_window", "rows128_long_one_sequence", "rows128_short_sequences", "rows96_d80_paged16",
            "rows128_paged64_window", "rows80_d64_paged16_softcap_sinks", "rows72_d64_paged256_window",
            "rows128_paged48", "rows128_paged12_window", "rows96_d80_paged12", "rows128_paged4",
            "rows128_paged8_window", "rows128_units_ranked_b48", "rows128_units_paged16_b80",
            "rows128_units_ranked_b200", "rows72_units_ranked_b100_buckets",
            "rows72_d64_units_balanced_b40"]


# (kernel, case) pairs run on a GPU with the kernel forced: calls of more than 16 packed rows (an H100/H200 runs those
# past 32 on a wgmma kernel) on the mma.sync kernel, which other GPUs run; calls that an H100/H200 runs on the TMA
# decode kernel (65-128 packed rows, dense or paged caches) on the cp.async wgmma kernel.
FORCED = [("sm80", name) for name in MANY_ROWS] + [("decode-cp-async", name) for name in TMA_ROWS]


@pytest.mark.parametrize("kernel,name", FORCED)
def test_forced_decode_kernel(kernel, name):
    """A call forced onto another decode kernel family: the same reference."""
    if not ON_GPU:
        pytest.skip("a GPU kernel choice")
    with jax_flash.force_kernel(kernel):
        out, lse, (ref_o, ref_lse) = _run(_case(name))
    _assert_matches(out, lse, ref_o, ref_lse)


def test_force_kernel_reaches_the_decode_target():
    """force_kernel("sm80") sets the decode call's kernel attribute (which RunFlashDecode dispatches on), and the
    default split plan reaches the call: balanced for a batch of few long splits, not for many short ones."""
    if not ON_GPU:
        pytest.skip("the decode target is lowered for CUDA only")
    from jax_flash import _ffi
    seen = set()
    for b, rows, hq, hkv, d, cap in ((16, 1, 32, 8, 128, 32768), (3, 8, 16, 2, 64, 4096)):
        args = (jax.ShapeDtypeStruct((b, rows, hq, d), DTYPE), jax.ShapeDtypeStruct((b, cap, hkv, d), DTYPE),
                jax.ShapeDtypeStruct((b,), jnp.int32))
        auto = jax.jit(lambda q, k, n: jax_flash.decode_attention(q, k, k, n)).lower(*args).as_text()
        with jax_flash.force_kernel("sm80"):  # (a function of its own: jit's cache does not know the choice)
            forced = jax.jit(lambda q, k, n: jax_flash.decode_attention(q, k, k, n)).lower(*args).as_text()
        splits, balance = _ffi.decode_split_plan((b, rows, hq, d), hkv, cap)
        seen.add(balance)
        for text, kernel in ((auto, 0), (forced, 1)):
            call = next(line for line in text.splitlines() if "jax_flash_decode" in line)
            assert re.search(rf"kernel = {kernel} : i32", call), call
            assert f"balance_splits = {str(balance).lower()}" in call, call
    assert seen == {False, True}


def test_decode_launch_shape_follows_the_kernel_choice():
    """The split count is sized from the kernel a call runs: on compute capability 9.0 a call of 64 packed rows at
    head dim 128 runs the cp.async wgmma kernel (one warpgroup, 3 stages), 65-128 rows (dense or paged caches) the
    TMA kernel (the forward's CTA: a producer and two consumer warpgroups, Q 128 rows and two stages of 128-key K/V
    tiles at d128, three at d64, one block an SM), with "decode-cp-async" the cp.async one's block of two
    warpgroups (6 stages), forced to the sm_80 class the mma.sync kernel (eight warps)."""
    if not ON_GPU:
        pytest.skip("needs the CUDA module and a GPU")
    from jax_flash import _ffi
    shape = _ffi._jax_flash_cuda.decode_launch_shape
    mma_sync_64 = ((64 * 128 + 2 * 3 * 64 * 128) * 2 + 3 * 64 * 4, 256)
    assert shape(128, 64, _ffi.KERNELS["sm80"]) == mma_sync_64
    assert shape(128, 32, _ffi.KERNELS["auto"]) == ((32 * 128 + 2 * 3 * 64 * 128) * 2 + 3 * 64 * 4, 256)
    assert shape(64, 300, _ffi.KERNELS["auto"]) == (0, 0)
    # head dim 256 stays on the mma.sync kernel everywhere (two row tiles of 32-key slices: four warps)
    assert shape(256, 32, _ffi.KERNELS["auto"]) == ((32 * 256 + 2 * 3 * 32 * 256) * 2 + 3 * 32 * 4, 128)
    if getattr(jax.devices("gpu")[0], "compute_capability", "") == "9.0":
        assert shape(128, 64, _ffi.KERNELS["auto"]) == ((64 * 128 + 2 * 3 * 64 * 128) * 2 + 3 * 64 * 4, 128)
        assert shape(128, 128, _ffi.KERNELS["decode-cp-async"]) == ((128 * 128 + 2 * 6 * 64 * 128) * 2 + 6 * 64 * 4,
                                                                    256)
        assert shape(64, 65, _ffi.KERNELS["decode-cp-async"]) == ((128 * 64 + 2 * 5 * 64 * 64) * 2 + 5 * 64 * 4, 256)
        assert shape(64, 33, _ffi.KERNELS["auto"]) == ((64 * 64 + 2 * 4 * 64 * 64) * 2 + 4 * 64 * 4, 128)
        # the TMA kernel: its shared storage (Q and the K/V rings, then the unused O buffer's stand-in and the
        # barriers in the last 1 KB) plus 1 KB of alignment slack
        assert shape(128, 128, _ffi.KERNELS["auto"]) == ((128 * 128 + 2 * 2 * 128 * 128) * 2 + 2 * 1024, 384)
        assert shape(64, 65, _ffi.KERNELS["auto"]) == ((128 * 64 + 3 * 2 * 128 * 64) * 2 + 2 * 1024, 384)
    else:
        assert shape(128, 64, _ffi.KERNELS["auto"]) == mma_sync_64


def test_rows_before_the_sequence_see_nothing():
    """kv_length < Tq: the rows at negative positions see no key under the causal mask (output 0, lse -inf)."""
    case = dict(CASES["paged16_t16_ragged"])  # its third sequence has 5 keys for 16 rows
    out, lse, (ref_o, _) = _run(case)
    assert not out[2, :11].any() and (lse[2, :11] == -np.inf).all()
    np.testing.assert_allclose(out[2, 11:], ref_o[2, 11:], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("name", ["dense_gqa_t1", "paged16_long_ragged", "rows128_paged64_window",
                                  "rows64_d64_softcap_sinks", "rows48_d64_paged16_softcap",
                                  "rows1024_d96_softcap_sinks", "d40_softcap_sinks", "combine_chunks_no_key",
                                  "rows72_d64_window_sinks", "rows112_d96_noncausal_b5"])
@pytest.mark.parametrize("num_splits", [1, 3, 8, 33, 64, 65, 256])
def test_independent_of_num_splits(name, num_splits):
    """Any split count (more splits than key tiles included) gives the default's result within rounding, sinks
    and soft cap included (33, 64, 65: split counts either side of where the combine changes kernel; 1024 output
    rows take the warp-per-row one up to 64 splits; 256 splits of few rows spread over column chunks, head dims
    under 64 sum their split groups by a tree, and rows that see no key write zeros in every chunk)."""
    base, base_lse, _ = _run(_case(name))
    out, lse, _ = _run(_case(name), num_splits=num_splits)
    np.testing.assert_allclose(out, base, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(lse, base_lse, atol=TOL, rtol=TOL)


# Ragged batches on every decode kernel family (mma.sync, wgmma, TMA; dense and paged; soft cap, sinks, windows)
# with balanced splits, which decode_split_plan picks only for few long splits (caches larger than a test needs).
BALANCED = ["rows32_ragged", "rows24_noncausal", "rows64_d64_balanced", "rows64_paged16_balanced",
            "rows48_d64_paged16_softcap", "rows1024_d96_softcap_sinks", "rows128_softcap_ragged",
            "rows112_d96_noncausal_b5", "rows128_paged12_window", "rows128_units_paged16_b80",
            "rows72_d64_units_balanced_b40", "balanced_zero_lengths_b10", "balanced_equal_b16",
            "rows48_balanced_zero_lengths"]


@pytest.mark.parametrize("name", BALANCED)
def test_balanced_splits_match_reference(name, monkeypatch):
    """Default calls planned with balanced splits (twice decode_splits' count, at least two, of one size across the
    batch; half of them without keys at equal lengths): the float64 reference."""
    if not ON_GPU:
        pytest.skip("the decode kernels' split plan")
    from jax_flash import _ffi
    monkeypatch.setattr(_ffi, "decode_split_plan", lambda q_shape, heads_kv, capacity, paged=False, uniform=False:
                        _ffi.balanced_split_plan(max(_ffi.decode_splits(q_shape, heads_kv, capacity, paged), 2)))
    out, lse, (ref_o, ref_lse) = _run(_case(name))
    _assert_matches(out, lse, ref_o, ref_lse)


def test_chain_of_calls_in_one_program():
    """Eight decode calls in one jitted program, each against the reference, the program run twice: on a GPU XLA
    records such a run of custom calls into one command buffer (a CUDA graph) by stream capture, which breaks if a
    handler does anything a capture forbids (a query of the stream did so in a patch whose tests ran each call
    alone: NOTES.md, session 58). Split plans mixed: the default ones, forced counts, one split."""
    rng = np.random.default_rng(13)
    b, hq, hkv, d, cap = 4, 8, 2, 64, 512
    cast = lambda x: jnp.asarray(x, DTYPE)  # noqa: E731
    q = rng.standard_normal((8, b, 1, hq, d))
    k, v = (rng.standard_normal((b, cap, hkv, d)) for _ in range(2))
    lengths = np.asarray([[512] * 4, [500, 90, 512, 1]] * 4, np.int32)
    splits = [None, None, 3, 8, None, 2, 64, 1]
    chain = jax.jit(lambda q, k, v, n: [jax_flash.decode_attention(q[i], k, v, n[i], num_splits=splits[i])
                                        for i in range(8)])
    for _ in range(2):  # a recorded command buffer runs again
        got = chain(cast(q), cast(k), cast(v), jnp.asarray(lengths))
        for i in range(8):
            ref, _ = _reference(*(np.asarray(cast(x), np.float64) for x in (q[i], k, v)), lengths[i])
            np.testing.assert_allclose(np.asarray(got[i], np.float64), ref, atol=TOL, rtol=TOL, err_msg=f"call {i}")


def test_paged_cache_size_limit():
    """A paged cache of 2**31 keys or more is refused at trace time (the kernels address pool rows in int32)."""
    q = jax.ShapeDtypeStruct((1, 1, 8, 8), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((2**22, 512, 8, 8), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    n = jax.ShapeDtypeStruct((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"at most 2\*\*31 - 1 keys"):
        jax.eval_shape(lambda q, k, n, t: jax_flash.decode_attention(q, k, k, n, page_table=t), q, pool, n, table)


def test_float16():
    if not ON_GPU:
        pytest.skip("float16 runs the CUDA decode kernel; the CPU path is tested in float32")
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 8, 64)).astype(np.float32)
    k, v = (rng.standard_normal((2, 500, 2, 64)).astype(np.float32) for _ in range(2))
    n = np.asarray([500, 77], np.int32)
    out = jax_flash.decode_attention(*(jnp.asarray(x, jnp.float16) for x in (q, k, v)), jnp.asarray(n))
    assert out.dtype == jnp.float16
    q16, k16, v16 = (np.asarray(jnp.asarray(x, jnp.float16), np.float64) for x in (q, k, v))
    ref, _ = _reference(q16, k16, v16, n)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=1e-2, rtol=1e-2)


def test_nonfinite_propagate_as_jax_nn():
    """A nan in a visible key makes the rows that see it nan; past kv_length it is never read."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 64)), DTYPE)
    k = np.asarray(rng.standard_normal((2, 300, 2, 64)), np.float32)
    k[0, 10] = np.nan   # seen by sequence 0
    k[1, 250] = np.nan  # past sequence 1's length
    k = jnp.asarray(k, DTYPE)
    out = jax_flash.decode_attention(q, k, k, jnp.asarray([300, 200], jnp.int32), num_splits=4)
    out = np.asarray(out, np.float32)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize("kernel", ["auto", "decode-cp-async"])
@pytest.mark.parametrize("page_size", [None, 16])
def test_nonfinite_outside_the_range_never_read_many_rows(kernel, page_size):
    """128 packed rows (the TMA decode kernel on an H100/H200 reads whole 128-key tiles of a dense cache and
    gathers a paged one; the cp.async kernel forced): nans in K and V past kv_length, and below a window's first
    key, leave every output finite."""
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((2, 16, 8, 128)), DTYPE)
    k, v = (np.asarray(rng.standard_normal((2, 608, 1, 128)), np.float32) for _ in range(2))
    for x in (k, v):
        x[0, 521:] = np.nan  # past sequence 0's length (mid-tile)
        x[1, 400] = np.nan   # below sequence 1's window (keys 484-599 seen), in its first 128-key tile (384-511)
    n = jnp.asarray([521, 600], jnp.int32)
    table = None
    if page_size:  # pages in order: sequence b's page j is pool page b * pages + j
        pages = 608 // page_size
        k, v = (x.reshape(2 * pages, page_size, 1, 128) for x in (k, v))
        table = jnp.arange(2 * pages, dtype=jnp.int32).reshape(2, pages)
    with jax_flash.force_kernel(kernel):
        for splits in (None, 1, 3):
            out = jax_flash.decode_attention(q, jnp.asarray(k, DTYPE), jnp.asarray(v, DTYPE), n, page_table=table,
                                             local_window_size=(100, 0), num_splits=splits)
            assert np.isfinite(np.asarray(out, np.float32)).all(), splits


def test_empty_cache_many_rows():
    """A dense cache of capacity 0 under 128 packed rows (the TMA kernel's tensor maps cannot have an empty
    dimension: the cp.async kernel takes it): every row sees no key, output 0 and lse -inf."""
    q = jnp.ones((1, 16, 8, 128), DTYPE)
    k = jnp.zeros((1, 0, 1, 128), DTYPE)
    out, lse = jax_flash.decode_attention(q, k, k, jnp.zeros((1,), jnp.int32), return_residual=True)
    assert not np.asarray(out, np.float32).any() and (np.asarray(lse) == -np.inf).all()


def test_vmap_matches_a_loop():
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((3, 2, 1, 4, 32)), DTYPE)
    k = jnp.asarray(rng.standard_normal((3, 2, 48, 2, 32)), DTYPE)
    n = jnp.asarray([[48, 5], [1, 30], [17, 48]], jnp.int32)
    f = lambda q, k, n: jax_flash.decode_attention(q, k, k, n)  # noqa: E731
    got = jax.jit(jax.vmap(f))(q, k, n)
    want = jnp.stack([f(q[i], k[i], n[i]) for i in range(3)])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOL, rtol=TOL)


def test_dot_product_attention_decode_call():
    """A jax.nn-style decode call (few rows, key_value_seq_lengths, not causal) runs the decode kernel forward on a
    GPU (its lowered HLO holds the decode target) and agrees with the reference, gradients included."""
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((2, 2, 8, 64)), DTYPE)
    k, v = (jnp.asarray(rng.standard_normal((2, 900, 2, 64)), DTYPE) for _ in range(2))
    n = jnp.asarray([900, 123], jnp.int32)
    f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, key_value_seq_lengths=n))
    if ON_GPU:
        targets = set(re.findall(r"custom_call @(\w+)", f.lower(q, k, v).as_text()))
        assert "jax_flash_decode" in targets, targets
    # both rows of a sequence see every key below its length: as decode rows of a non-causal call
    want = jax_flash.decode_attention(q, k, v, n, is_causal=False)
    np.testing.assert_allclose(np.asarray(f(q, k, v), np.float32), np.asarray(want, np.float32), atol=TOL, rtol=TOL)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
    grads = jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n)),
                   argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=5 * TOL, rtol=5 * TOL)


def test_combine_equals_one_call():
    """Two calls over the halves of each cache (the second with its rows' positions after the first half) merge to
    one call over the whole cache."""
    rng = np.random.default_rng(1)
    b, rows, hq, hkv, d, cap = 2, 1, 4, 2, 64, 64
    q = jnp.asarray(rng.standard_normal((b, rows, hq, d)), DTYPE)
    k, v = (jnp.asarray(rng.standard_normal((b, cap, hkv, d)), DTYPE) for _ in range(2))
    n = jnp.full((b,), cap, jnp.int32)
    whole, whole_lse = jax_flash.decode_attention(q, k, v, n, is_causal=False, return_residual=True)
    half = cap // 2
    parts = [jax_flash.decode_attention(q, k[:, s], v[:, s], jnp.full((b,), half, jnp.int32), is_causal=False,
                                        return_residual=True) for s in (slice(0, half), slice(half, cap))]
    out, lse = jax_flash.combine(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(whole, np.float32), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(whole_lse), atol=TOL, rtol=TOL)
    # a part that sees nothing weighs nothing
    empty = jax_flash.decode_attention(q, k, v, jnp.zeros((b,), jnp.int32), is_causal=False, return_residual=True)
    out2, lse2 = jax_flash.combine(jnp.stack([whole, empty[0]]), jnp.stack([whole_lse, empty[1]]))
    np.testing.assert_allclose(np.asarray(out2, np.float32), np.asarray(whole, np.float32), atol=TOL, rtol=TOL)


def test_gqa_matches_dot_product_attention_at_full_cache():
    """With every sequence full and Tq = S, decode_attention is dot_product_attention (causal alignments agree)."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 16, 8, 64)), DTYPE)
    k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 64)), DTYPE) for _ in range(2))
    a = jax_flash.decode_attention(q, k, v, jnp.full((2,), 16, jnp.int32))
    b = jax_flash.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=TOL, rtol=TOL)


BAD = {
    "rows": (dict(rows=17), ValueError, "1 to 16 query rows"),
    "lengths_range": (dict(lengths=[5, 99]), ValueError, r"kv_lengths must lie in \[0, 32\]"),
    "lengths_negative": (dict(lengths=[-1, 3]), ValueError, "kv_lengths must lie in"),
    "lengths_dtype": (dict(lengths=np.array([3, 3], np.int64)), ValueError, "kv_lengths must be int32"),
    "lengths_shape": (dict(lengths=[3, 3, 3]), ValueError,
                      r"kv_lengths must be int32 of shape \(batch,\) = \(2,\), or \(\) .* got shape \(3,\)"),
    "one_length_range": (dict(lengths=np.int32(33)), ValueError, r"kv_lengths must lie in \[0, 32\]"),
    "one_length_dtype": (dict(lengths=np.int64(3)), ValueError, "kv_lengths must be int32"),
    "page_ids": (dict(paged=True, table=[[0, 9], [1, 2]]), ValueError, r"page_table\[0\] holds page ids outside"),
    "page_table_shape": (dict(paged=True, table=[[0, 1]]), ValueError, "page_table must be int32 of shape"),
    "heads": (dict(hq=3), ValueError, "multiple of the caches' key/value heads"),
    "splits": (dict(num_splits=0), ValueError, r"num_splits must be None or an int in \[1, 1024\]"),
    "splits_many": (dict(num_splits=1025), ValueError, r"num_splits must be None or an int in \[1, 1024\]"),
    "head_dim_zero": (dict(head_dim=0), ValueError, "head_dim must be a positive multiple of 8"),
    "page_size_zero": (dict(paged=True, pool=(4, 0), table=[[0, 1], [1, 2]]), ValueError,
                       "needs at least one page of at least one key"),
    "no_pages": (dict(paged=True, pool=(0, 16), table=[[0, 1], [1, 2]]), ValueError,
                 "needs at least one page of at least one key"),
    "sinks_inf": (dict(sinks=[0.0, np.inf, 0.0, 0.0]), ValueError, "sinks must be finite"),
    "residual_str": (dict(return_residual="no"), TypeError, "return_residual must be a bool, got str"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_arguments(name):
    bad, error, message = BAD[name]
    hq, d = bad.get("hq", 4), bad.get("head_dim", 32)
    q = jnp.zeros((2, bad.get("rows", 1), hq, d), DTYPE)
    lengths = bad.get("lengths", [3, 3])
    lengths = lengths if isinstance(lengths, (np.ndarray, np.generic)) else np.asarray(lengths, np.int32)
    sinks = None if "sinks" not in bad else np.asarray(bad["sinks"], np.float32)
    if bad.get("paged"):
        k = jnp.zeros((*bad.get("pool", (4, 16)), 2, d), DTYPE)
        table = np.asarray(bad["table"], np.int32)
        call = lambda: jax_flash.decode_attention(q, k, k, np.asarray([20, 20], np.int32), page_table=table)  # noqa
    else:
        k = jnp.zeros((2, 32, 2, d), DTYPE)
        call = lambda: jax_flash.decode_attention(q, k, k, lengths, num_splits=bad.get("num_splits"),  # noqa
                                                  sinks=sinks, return_residual=bad.get("return_residual", False))
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("rows,heads_q,head_dim,page_size", [(1, 2, 32, 16), (16, 8, 128, 16), (16, 8, 128, 12)])
def test_traced_bad_values_read_nothing_outside(rows, heads_q, head_dim, page_size):
    """Under jit the values are not known: page ids and lengths out of range are clamped (finite results, no
    out-of-bounds read), at 2 packed rows and at 128 (the TMA kernel's gather on an H100/H200: one lookup for 8
    keys at pages of 16, one per key at pages of 12)."""
    q = jnp.ones((1, rows, heads_q, head_dim), DTYPE)
    k = jnp.ones((2, page_size, 1, head_dim), DTYPE)
    f = jax.jit(lambda t, n: jax_flash.decode_attention(q, k, k, n, page_table=t))
    out = f(jnp.asarray([[5, -3]], jnp.int32), jnp.asarray([1000], jnp.int32))
    assert np.isfinite(np.asarray(out, np.float32)).all()


def test_page_table_padding_under_jit_with_traced_lengths():
    """A constant page table padded with -1 past the pages its sequences use, with the lengths traced: nothing to
    check (which entries are used depends on the lengths) and the results match the eager call."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 64)), DTYPE)
    k, v = (jnp.asarray(rng.standard_normal((6, 16, 2, 64)), DTYPE) for _ in range(2))
    table = np.asarray([[0, -1, -1], [3, 4, -1]], np.int32)
    n = np.asarray([9, 30], np.int32)
    eager = jax_flash.decode_attention(q, k, v, n, page_table=table)
    traced = jax.jit(lambda n: jax_flash.decode_attention(q, k, v, n, page_table=table))(n)
    np.testing.assert_array_equal(np.asarray(traced, np.float32), np.asarray(eager, np.float32))


COMBINE_BAD = {
    "axis_past_rank": (dict(axis=5), ValueError, r"axis must be an int in \[-4, 4\)"),
    "axis_below": (dict(axis=-5), ValueError, r"axis must be an int in \[-4, 4\)"),
    "axis_float": (dict(axis=1.0), ValueError, "axis must be an int"),
    "integer_outputs": (dict(outputs_dtype=np.int32), TypeError, "must be floating-point"),
    "scalar_lses": (dict(lses_shape=()), ValueError, "must agree"),
    "shapes": (dict(lses_shape=(2, 2, 1, 3)), ValueError, "must agree"),
}


@pytest.mark.parametrize("name", COMBINE_BAD)
def test_combine_bad_arguments(name):
    """An axis outside lses' dims is an error, not wrapped around onto another axis (which would merge over the
    batch); outputs that are not floating-point are refused, not truncated."""
    bad, error, message = COMBINE_BAD[name]
    outputs = np.zeros((2, 2, 1, 4, 8), bad.get("outputs_dtype", np.float32))
    lses = np.zeros(bad.get("lses_shape", (2, 2, 1, 4)), np.float32)
    with pytest.raises(error, match=message):
        jax_flash.combine(outputs, lses, axis=bad.get("axis", 0))


def test_combine_along_a_later_axis():
    """The parts stacked along axis 1 (or -3) merge as along axis 0."""
    rng = np.random.default_rng(5)
    outputs = jnp.asarray(rng.standard_normal((3, 2, 1, 4, 8)), jnp.float32)
    lses = jnp.asarray(rng.standard_normal((3, 2, 1, 4)), jnp.float32)
    ref_out, ref_lse = jax_flash.combine(outputs, lses)
    for axis in (1, -3):
        out, lse = jax_flash.combine(jnp.moveaxis(outputs, 0, 1), jnp.moveaxis(lses, 0, 1), axis=axis)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6, atol=1e-6)


def test_decode_kernel_that_does_not_fit_the_gpu_runs_the_attention_kernel(monkeypatch, fresh_warnings):
    """Where the decode kernel does not fit the GPU's shared memory per block (above head dim 64 on sm_86 / sm_89:
    99 KB), decode_attention warns once and runs the attention kernel, and dot_product_attention's few-row calls keep
    the attention kernel (no decode target in the program): results as the float64 reference. On a GPU the
    "sm80-small-smem" choice decides the fit as on a 99 KB device; elsewhere the fit is patched."""
    from jax_flash import _ffi

    if not _ffi.CUDA_REGISTERED:
        pytest.skip("needs jax_flash's CUDA targets (the check sits on the CUDA path)")
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((2, 4, 8, 128)), jnp.bfloat16)  # bfloat16: the CUDA path's dtype
    k, v = (jnp.asarray(rng.standard_normal((2, 96, 2, 128)), jnp.bfloat16) for _ in range(2))
    n = np.asarray([96, 37], np.int32)
    ref_o, ref_lse = _reference(q, k, v, n)

    def run():
        with pytest.warns(RuntimeWarning, match="needs more shared memory per block than this GPU has"):
            out, lse = jax_flash.decode_attention(q, k, v, n, return_residual=True)
        _assert_matches(out, lse, ref_o, ref_lse) if ON_GPU else np.testing.assert_allclose(
            np.asarray(out, np.float32), ref_o, atol=3e-2, rtol=3e-2)
        # dot_product_attention at few rows: the decode target only where the kernel fits
        program = str(jax.make_jaxpr(lambda q, k, v: jax_flash.dot_product_attention(q, k, v))(q, k, v))
        assert "jax_flash_decode" not in program and "jax_flash_fwd" in program

    if ON_GPU:
        if getattr(jax.devices("gpu")[0], "compute_capability", "") == "9.0":
            assert _ffi.decode_fits_device(128, 16)  # an H100 / H200: 227 KB a block
        with jax_flash.force_kernel("sm80-small-smem"):
            assert not _ffi.decode_fits_device(128, 16) and _ffi.decode_fits_device(64, 16)
            run()
    else:
        monkeypatch.setattr(_ffi, "decode_fits_device", lambda head_dim, packed_rows: head_dim <= 64)
        run()
        fits = str(jax.make_jaxpr(lambda q, k, v: jax_flash.dot_product_attention(q, k, v))(q[..., :64], k[..., :64],
                                                                                           v[..., :64]))
        assert "jax_flash_decode" in fits


def test_forward_only():
    q = jnp.ones((1, 1, 2, 32), DTYPE)
    k = jnp.ones((1, 8, 1, 32), DTYPE)
    n = jnp.asarray([8], jnp.int32)
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(lambda q: jnp.sum(jax_flash.decode_attention(q, k, k, n).astype(jnp.float32)))(q)
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(lambda k: jnp.sum(jax_flash.decode_attention(q, k, k, n).astype(jnp.float32)))(k)
    sinks = jnp.zeros((2,), jnp.float32)  # the sinks alone (a Flax decode step's one trainable input)
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(lambda s: jnp.sum(jax_flash.decode_attention(q, k, k, n, sinks=s).astype(jnp.float32)))(sinks)


def _fake_h100_launch_shapes(monkeypatch):
    """The split plan's view of an H100/H200 without one: 132 SMs, and the CUDA module's launch shapes at d128
    (~100 KB and 128 threads up to 64 packed rows, ~226 KB and 256 threads, one block an SM, past that)."""
    from jax_flash import _ffi

    class FakeCudaModule:
        @staticmethod
        def decode_launch_shape(head_dim, packed_rows, kernel):
            return (226 * 1024, 256) if packed_rows > 64 else (102 * 1024, 128)

        @staticmethod
        def decode_fits_device(head_dim, packed_rows, kernel):
            return True

        @staticmethod
        def attention_fits_device(head_dim, backward, kernel):
            return True

    monkeypatch.setattr(_ffi, "_jax_flash_cuda", FakeCudaModule)
    monkeypatch.setattr(_ffi, "cuda_device_count", lambda: 1)
    for name in ("_decode_fits", "_attention_fits"):  # fresh caches for the fake (the real ones come back after)
        monkeypatch.setattr(_ffi, name, functools.cache(getattr(_ffi, name).__wrapped__))
    monkeypatch.setattr(_ffi, "_sm_count", lambda: 132)


def test_split_count_fills_one_wave(monkeypatch):
    """decode_splits sizes the grid to the blocks the GPU holds at once (from the kernel's shared memory and
    threads; one block per SM for one sequence at one query row over at most 8 kv heads), with at least two key
    tiles per split and bounded partial-result traffic."""
    from jax_flash import _ffi

    _fake_h100_launch_shapes(monkeypatch)
    # two blocks per SM: 264 resident; one sequence at Tq 1 over 8 kv heads: one block per SM, 16 splits; 8 sequences
    # x 1 kv head -> 33; 16 x 8 = 128 (sequence, kv head) pairs -> 2; 64 x 8 = 512 >= 264 -> 1; one sequence at Tq 2: 33
    assert _ffi.decode_splits((1, 1, 32, 128), 8, 131072) == 16
    assert _ffi.decode_splits((8, 1, 8, 128), 1, 32768) == 33
    assert _ffi.decode_splits((16, 1, 32, 128), 8, 32768) == 2
    assert _ffi.decode_splits((64, 1, 32, 128), 8, 8192) == 1
    assert _ffi.decode_splits((1, 2, 32, 128), 8, 131072) == 33
    assert _ffi.decode_splits((1, 1, 32, 128), 8, 131072, paged=True) == 33  # paged: two blocks an SM stay faster
    # short caches: at least two 64-key tiles per split; many packed rows: the partials' traffic bound
    assert _ffi.decode_splits((1, 1, 32, 128), 8, 512) == 4
    assert _ffi.decode_splits((1, 16, 32, 128), 8, 4096) == 4096 // (8 * 64)
    # one sequence of 128 packed rows (MQA at Tq 16): 128 of the 132 SMs' blocks (the bound at a quarter)
    assert _ffi.decode_splits((1, 16, 8, 128), 1, 131072) == 128
    # 128 packed rows: one block an SM holds, half the splits
    assert _ffi.decode_splits((1, 16, 64, 128), 8, 131072) == 16
    # left to jax_flash, a batch of few splits each (<= 8) that are long (>= 4096 keys) or over many (sequence, kv
    # head) pairs (>= 64) gets twice the splits, of one size across the batch; many splits, few short ones over few
    # pairs, one sequence, or one split each stay as they are
    assert _ffi.decode_split_plan((4, 1, 32, 128), 8, 32768) == (16, True)
    assert _ffi.decode_split_plan((16, 1, 32, 128), 8, 32768) == (4, True)
    assert _ffi.decode_split_plan((64, 4, 8, 128), 1, 8192)[1]  # 2048 keys a split, 64 pairs, Tq 4
    # ... but where only the pairs ask for it, at one query row, a head dim up to 128 and a dense cache, twice the
    # splits without balancing (16 x 8 pairs of 4160 keys: LLaMA generation at batch 16)
    assert _ffi.decode_split_plan((64, 1, 8, 128), 1, 8192) == (8, False)
    assert _ffi.decode_split_plan((16, 1, 32, 128), 8, 4160) == (4, False)
    assert _ffi.decode_split_plan((64, 1, 8, 128), 1, 8192, paged=True)[1]
    assert _ffi.decode_split_plan((16, 1, 16, 256), 8, 4160)[1]
    assert _ffi.decode_split_plan((4, 1, 32, 128), 8, 16384) == (8, False)  # 2048 keys a split, 32 pairs
    assert _ffi.decode_split_plan((8, 1, 8, 128), 1, 32768) == (33, False)  # 33 splits a sequence
    assert _ffi.decode_split_plan((1, 1, 32, 128), 8, 131072) == (16, False)
    assert _ffi.decode_split_plan((1, 1, 32, 128), 8, 131072, paged=True) == (33, False)
    assert _ffi.decode_split_plan((64, 1, 32, 128), 8, 8192) == (1, False)
    # every sequence equally long (stated by the caller): the fewest splits that give 90 % of the block slots a block
    # (one an SM up to 32 packed rows, else the kernel's blocks an SM; up to 64 packed rows, dense caches), no
    # balancing, never more than decode_splits' count; one sequence keeps its plan
    assert _ffi.decode_split_plan((16, 1, 32, 128), 8, 4160, uniform=True) == (1, False)  # 128 pairs
    assert _ffi.decode_split_plan((64, 1, 8, 128), 1, 8192, uniform=True) == (2, False)  # 64 pairs
    assert _ffi.decode_split_plan((8, 1, 32, 128), 8, 32768, uniform=True) == (2, False)
    assert _ffi.decode_split_plan((16, 1, 16, 256), 8, 4160, uniform=True) == (1, False)
    assert _ffi.decode_split_plan((64, 4, 8, 128), 1, 8192, uniform=True) == (2, False)
    # paged caches keep the ordinary plan (one block an SM reads pages slower)
    assert (_ffi.decode_split_plan((8, 1, 32, 128), 8, 32768, paged=True, uniform=True)
            == _ffi.decode_split_plan((8, 1, 32, 128), 8, 32768, paged=True) == (8, True))
    assert _ffi.decode_split_plan((8, 1, 8, 128), 1, 32768, uniform=True) == (15, False)  # 8 pairs: 120 blocks
    assert _ffi.decode_split_plan((4, 1, 32, 128), 8, 512, uniform=True) == (4, False)  # decode_splits' 4 (tiles)
    assert _ffi.decode_split_plan((1, 1, 32, 128), 8, 131072, uniform=True) == (16, False)
    assert _ffi.decode_split_plan((16, 16, 32, 128), 8, 4160, uniform=True) == (2, False)  # 64 rows: 2 an SM
    assert _ffi.decode_split_plan((8, 16, 32, 128), 8, 32768, uniform=True) == (4, False)
    # past 64 packed rows (the TMA kernel) the ordinary plan
    assert (_ffi.decode_split_plan((64, 16, 8, 128), 1, 8192, uniform=True)
            == _ffi.decode_split_plan((64, 16, 8, 128), 1, 8192) == (4, True))


def test_one_length_reaches_the_split_plan(monkeypatch):
    """kv_lengths given as one scalar (and jax.nn-style calls without key_value_seq_lengths) plan the CUDA decode
    call's splits for equal lengths and tell the kernels so (equal_lengths: no longest-first ranking): lowered for
    CUDA (also without a GPU), 16 sequences x 8 kv heads of 4160 keys take one split (no combine workspace rows
    beyond one), against 4 with a length per sequence."""
    from jax_flash import _ffi

    _fake_h100_launch_shapes(monkeypatch)
    monkeypatch.setattr(_ffi, "CUDA_REGISTERED", True)  # a CPU-only build lowers the CUDA branch too
    q = jax.ShapeDtypeStruct((16, 1, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((16, 4160, 8, 128), jnp.bfloat16)

    def decode_call(f, *args):
        """(workspace splits, equal_lengths) of the lowered decode call."""
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        call = next(line for line in text.splitlines() if "jax_flash_decode" in line)
        equal = re.search(r"equal_lengths = (true|false)", call).group(1) == "true"
        return int(re.search(r"tensor<(\d+)x16x1x32x128xf32>", call).group(1)), equal

    per_sequence = jax.ShapeDtypeStruct((16,), jnp.int32)
    one = jax.ShapeDtypeStruct((), jnp.int32)
    assert decode_call(lambda q, k, n: jax_flash.decode_attention(q, k, k, n), q, k, per_sequence) == (4, False)
    assert decode_call(lambda q, k, n: jax_flash.decode_attention(q, k, k, n), q, k, one) == (1, True)
    assert decode_call(lambda q, k: jax_flash.dot_product_attention(q, k, k), q, k) == (1, True)
    assert decode_call(lambda q, k, n: jax_flash.dot_product_attention(q, k, k, key_value_seq_lengths=n),
                       q, k, per_sequence) == (4, False)


def test_sharded_calls_partition_as_dot_product_attention():
    """Batch- and head-sharded decode calls under jit (a ("dp", "tp") mesh of 8 fake CPU devices, in a subprocess:
    tests/sharding_check.py's decode cases) give the unsharded call's output and lse with no collective and keep q's
    sharding: per-sequence lengths and one length, dense caches and (dp, tp) paged ones, on Auto axes and (a
    batch-sharded page table) Explicit ones."""
    if ON_GPU:
        pytest.skip("a CPU subprocess (runs once, on the CPU pass)")
    cases = [f"decode:{c}" for c in ("dp:per-sequence:dense", "dp:one:dense", "tp:one:dense", "tp:per-sequence:dense",
                                     "dp_tp:per-sequence:dense", "dp_tp:one:dense", "dp:one:paged16",
                                     "tp:per-sequence:paged16", "dp:per-sequence:paged16:Explicit",
                                     "dp_tp:per-sequence:paged16:Explicit", "dp_tp:one:dense:Explicit")]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-P", str(pathlib.Path(__file__).with_name("sharding_check.py")), *cases],
                          env=env, capture_output=True, text=True, timeout=600, cwd="/")
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = {r["case"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    assert list(results) == cases, proc.stderr[-5000:]
    specs = {"dp": "P('dp')", "tp": "P(None, None, 'tp')", "dp_tp": "P('dp', None, 'tp')"}
    norm = lambda text: re.sub(r"(, None)+\)$", ")", text).replace(",)", ")")  # noqa: E731 - trailing Nones
    for case, r in results.items():
        assert r["ok"], (case, r.get("trace"))
        assert r["out_err"] <= 1e-5 and r["lse_err"] <= 1e-5, (case, r)
        assert r["collectives"] == {}, (case, r)
        assert norm(r["out_spec"]) == specs[case.split(":")[1]], (case, r)
