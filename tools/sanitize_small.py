"""Small forward+backward calls for compute-sanitizer (memcheck, racecheck): every head-dim class, odd lengths, Sq !=
Sk, GQA, each mask, segment ids (packed and in any order), sinks and soft-capping, on the default kernels and the
sm_80-class ones; then decode calls (dense and paged, ragged, every row-tile count, out-of-range page ids and lengths
under jit, many splits) on both decode kernels; the segment-operands target alone (--segment-ops-only). Run as `compute-sanitizer --tool memcheck python
tools/sanitize_small.py`."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, kwargs)
    (1, 17, 97, 2, 1, 64, dict()),
    (2, 97, 33, 4, 2, 128, dict(is_causal=True)),
    (1, 65, 130, 2, 2, 256, dict(local_window_size=(7, 3))),
    (2, 40, 70, 2, 1, 72, dict(query_seq_lengths=np.array([40, 9], np.int32),
                               key_value_seq_lengths=np.array([0, 50], np.int32))),
    (1, 129, 129, 1, 1, 200, dict(is_causal=True, local_window_size=20)),
    # more forward work units than SMs: persistent CTAs take several tiles
    (2, 640, 640, 32, 8, 128, dict(is_causal=True)),
    # more backward units (key block, kv head, batch) than SMs: persistent backward CTAs take two or three
    (4, 256, 256, 40, 40, 64, dict()),
    # segment ids (packed, padding id at the end; in any order with Sq != Sk), sinks, soft cap
    (2, 300, 300, 4, 2, 128, dict(is_causal=True, segments="packed", sinks=True, logits_soft_cap=20.0)),
    (1, 77, 150, 2, 1, 64, dict(segments="random", logits_soft_cap=5.0)),
    (1, 130, 130, 2, 2, 256, dict(is_causal=True, segments="packed", sinks=True)),
    # one query row: the backward's query tiles past it (rows padded to 128) have no row at all
    (3, 1, 70, 2, 1, 128, dict(is_causal=True)),
    # soft cap without segment ids (the capped d64/d128 backward's packed dS^T product in unmasked tiles, its float32
    # one in masked tiles)
    (2, 200, 330, 4, 2, 128, dict(is_causal=True, logits_soft_cap=20.0)),
    (1, 150, 150, 2, 1, 64, dict(logits_soft_cap=5.0)),
    # the capped d128 forward without a mask (three warpgroups, 192-row tiles: a ragged last tile), with segment ids
    (2, 250, 330, 4, 2, 128, dict(logits_soft_cap=20.0)),
    (2, 300, 300, 4, 2, 128, dict(segments="packed", sinks=True, logits_soft_cap=20.0)),
    # those tiles causal (from 4096 rows, units from a work counter: warpgroups without a diagonal tile's keys), and
    # with lengths (warpgroups whose rows lie past a query length)
    (1, 8195, 8195, 1, 1, 128, dict(is_causal=True, logits_soft_cap=30.0)),
    (3, 250, 250, 4, 2, 128, dict(logits_soft_cap=30.0, query_seq_lengths=np.array([250, 70, 0], np.int32),
                                  key_value_seq_lengths=np.array([250, 30, 9], np.int32))),
    # the causal capped tiles with more units than SMs: CTAs take several from the work counter
    (1, 4100, 4100, 32, 8, 128, dict(is_causal=True, logits_soft_cap=30.0)),
    # the 192-row persistent grids without a mask (capped d128, d64) over several rounds: CTAs skewed one place a round
    (2, 1000, 1000, 32, 8, 128, dict(logits_soft_cap=20.0)),
    (2, 1000, 1000, 16, 16, 64, dict()),
]


def _options(rng, b, sq, sk, hq, kw):
    """The case's keyword arguments with its segment ids and sinks made."""
    kw = dict(kw)
    kind = kw.pop("segments", None)
    if kind == "packed":
        ids = np.searchsorted(np.array([sq // 5, sq // 2, sq - 11]), np.arange(sq), side="right")
        kw["q_segment_ids"] = jnp.asarray(np.broadcast_to(ids, (b, sq)), jnp.int32)
    elif kind == "random":
        kw["q_segment_ids"] = jnp.asarray(rng.integers(0, 3, (b, sq)), jnp.int32)
        kw["kv_segment_ids"] = jnp.asarray(rng.integers(0, 3, (b, sk)), jnp.int32)
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.standard_normal(hq), jnp.float32)
    return kw


def main(cases=slice(None)):
    rng = np.random.default_rng(0)
    # then the segment-id cases (with sinks and soft caps) on the sm_80-class kernels
    calls = [(c, "auto") for c in CASES] + [(c, "sm80") for c in CASES if "segments" in c[-1]]
    for (b, sq, sk, hq, hkv, d, kw), kernel in calls[cases]:
        kw = _options(rng, b, sq, sk, hq, kw)
        for dtype in (jnp.bfloat16, jnp.float16):
            q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype)
            k = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), dtype)
            v = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), dtype)
            f = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, **kw)
            with jax_flash.force_kernel(kernel):
                out, vjp = jax.vjp(f, q, k, v)
                grads = vjp(jnp.ones_like(out))
            finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (out, *grads))
            names = sorted(n for n in kw if n not in ("q_segment_ids", "kv_segment_ids", "sinks")) + sorted(
                n for n in ("q_segment_ids", "kv_segment_ids", "sinks") if n in kw)
            print(f"B={b} Sq={sq} Sk={sk} Hq={hq} Hkv={hkv} D={d} {jnp.dtype(dtype).name} {kernel} {names}: "
                  f"finite={finite}", flush=True)


DECODE_CASES = [
    # (B, Tq, Hq, Hkv, D, capacity, page_size, num_splits, kwargs)
    (3, 1, 8, 2, 64, 200, None, None, dict()),
    (2, 4, 16, 2, 128, 333, 16, 5, dict(local_window_size=(50, 0))),
    (1, 8, 8, 1, 256, 130, None, 3, dict(is_causal=False, sinks=True, logits_soft_cap=10.0)),
    (2, 16, 8, 1, 96, 256, 64, 64, dict()),
    (2, 8, 16, 2, 64, 300, None, None, dict(logits_soft_cap=10.0)),
    # default splits of a batch: balanced splits (the block-wide sum of the batch's tiles), wgmma and mma.sync
    (3, 8, 16, 2, 64, 4096, None, None, dict()),
    (3, 16, 8, 2, 128, 4096, 16, None, dict()),
    (3, 1, 32, 8, 128, 4096, 64, None, dict()),
    # the wgmma kernel's paged + soft-cap variant with padding rows (40 packed rows) and a window
    (2, 5, 8, 1, 128, 1024, 16, None, dict(logits_soft_cap=15.0, local_window_size=(200, 0))),
    # 1024 output rows of 8 splits: the warp-per-row combine (16 float4 columns at d64: half the lanes idle)
    (8, 16, 8, 1, 64, 300, None, 8, dict(sinks=True)),
    # 80 and 128 packed rows (the TMA kernel on an H100/H200; forced, the wgmma kernel's two warpgroups at d64 (the
    # 5-stage ring) and d128 (the 6-stage ring at the shared-memory limit)): paged + soft cap (+ sinks, 48 padding
    # rows), and dense ragged
    (2, 10, 8, 1, 64, 2000, 16, None, dict(logits_soft_cap=12.0, sinks=True)),
    (2, 16, 8, 1, 128, 3000, 64, None, dict(logits_soft_cap=20.0)),
    (3, 16, 8, 1, 128, 3000, None, None, dict()),
    # more splits than the warp-per-row combine takes (the block-per-row one); 8 rows of 256 splits (more than the
    # 128 key tiles: empty splits) over 8 column chunks
    (1, 1, 32, 8, 128, 8192, None, 100, dict(sinks=True)),
    (1, 1, 8, 1, 128, 8192, None, 256, dict(sinks=True)),
    # one split per sequence: ragged batches taken longest first (mma.sync; wgmma at 64 packed rows), and past 64
    # sequences in batch order (those kernels rank at most 64)
    (40, 1, 4, 2, 64, 200, None, 1, dict()),
    (24, 8, 16, 2, 128, 250, 16, 1, dict()),
    (300, 1, 2, 1, 64, 64, None, 1, dict()),
    (5, 2, 8, 2, 128, 160, None, 1, dict(equal_lengths=True)),
    # the TMA kernel (65-128 packed rows, dense): 56 padding rows at d64 with a window and sinks (keys below the
    # window zeroed in the first tile); a padded head dim capped over 3 splits of a ragged batch
    (2, 9, 8, 1, 64, 1000, None, None, dict(local_window_size=(300, 0), sinks=True)),
    (5, 14, 8, 1, 96, 777, None, 3, dict(is_causal=False, logits_soft_cap=5.0)),
    # 128 and 72 packed rows over pages of 16 (capped, sinks) and of 256 (the TMA kernel's gather)
    (3, 16, 8, 1, 128, 1000, 16, None, dict(logits_soft_cap=20.0, sinks=True)),
    (2, 9, 8, 1, 64, 1024, 256, 3, dict(local_window_size=(300, 0))),
    # more TMA-kernel units (CTAs) than the GPU runs at once: 48 x 4 units of one split each, ranked longest first;
    # 80 x 2 paged units, ranked as a grid of a few waves (decode::RankBatch)
    (48, 16, 32, 4, 128, 200, None, 1, dict()),
    (80, 16, 16, 2, 128, 160, 16, 1, dict()),
    # one split a sequence in batch order, dense (the TMA kernel's Q and tile 0 loaded before the length is read):
    # 70 sequences of up to 300 keys, one of none (its unit waits for the early loads); one sequence in a cache
    # shorter than the tile, capped with sinks
    (70, 16, 8, 1, 128, 300, None, 1, dict(one_empty=True)),
    (1, 9, 8, 1, 64, 100, None, 1, dict(logits_soft_cap=12.0, sinks=True)),
    # pages of 12 keys (the TMA kernel's gather looks each key up), and of 4 at a padded head dim
    (2, 16, 8, 1, 128, 300, 12, None, dict(local_window_size=(100, 0))),
    (2, 12, 8, 1, 80, 200, 4, None, dict()),
    # one row tile over 3-16 splits and the combine's block kernel: ragged (short sequences: empty splits), paged
    # d256 with a cap and sinks, 16 rows at d64 with a window, 16 splits of 4 rows
    (3, 1, 8, 1, 128, 1000, None, 8, dict()),
    (2, 2, 4, 2, 256, 512, 16, 5, dict(logits_soft_cap=20.0, sinks=True)),
    (2, 4, 4, 1, 64, 700, None, 3, dict(local_window_size=(200, 0))),
    (1, 1, 32, 8, 128, 4096, None, 16, dict()),
    # balanced plans of 16 sequences x 4 kv heads (8 splits on 132 SMs, mma.sync): ragged lengths (the short
    # sequences leave some of their splits empty; sequences of no key are test_decode's balanced cases), and equal
    # lengths (half of the splits empty)
    (16, 2, 8, 4, 64, 512, None, None, dict()),
    (16, 2, 8, 4, 64, 512, None, None, dict(equal_lengths=True)),
    # TMA-kernel grids of a few waves, ranked (decode::RankBatch): 200 ragged sequences, one of no key, and 100 x 2
    # of up to 47 tiles (several a bucket of the ranking)
    (200, 16, 8, 1, 128, 300, None, 1, dict(one_empty=True)),
    (100, 16, 16, 2, 128, 6000, None, 1, dict()),
    # TMA-kernel grids of more than four waves, unranked: the persistent grid (DecodeTmaGrid::kPersistent), dense
    # with a sequence of no key, paged, and 40 x 16 equal splits at d64 (empty units among the others)
    (300, 16, 16, 2, 128, 200, None, 1, dict(one_empty=True)),
    (300, 16, 16, 2, 128, 192, 16, 1, dict()),
    (40, 9, 8, 1, 64, 4000, None, 16, dict()),
    # one split a sequence over at most 64 sequences in one wave of the TMA kernel: unranked, so the early first tile
    # (a sequence of no key among them)
    (40, 16, 8, 1, 128, 300, None, 1, dict(one_empty=True)),
]


def decode(kernels=("auto", "decode-cp-async", "sm80"), cases=slice(None)):
    """Each case on the default decode kernels, on the cp.async wgmma kernel where an H100/H200 runs the TMA one
    (65-128 packed rows), and forced onto the sm_80-class (mma.sync) one, which an H100/H200
    runs by default only up to 32 packed rows."""
    for kernel in kernels:
        with jax_flash.force_kernel(kernel):
            decode_cases(kernel, cases)


def decode_cases(kernel, cases):
    rng = np.random.default_rng(1)
    for b, tq, hq, hkv, d, cap, page_size, splits, kw in DECODE_CASES[cases]:
        kw = dict(kw)
        if kw.pop("sinks", False):
            kw["sinks"] = jnp.asarray(rng.standard_normal(hq), jnp.float32)
        q = jnp.asarray(rng.standard_normal((b, tq, hq, d)), jnp.bfloat16)
        lengths = jnp.asarray(rng.integers(0, cap + 1, b), jnp.int32).at[0].set(cap)
        if kw.pop("equal_lengths", False):
            lengths = jnp.full((b,), cap, jnp.int32)
        if kw.pop("one_empty", False):
            lengths = lengths.at[1].set(0)
        if page_size is None:
            k, v = (jnp.asarray(rng.standard_normal((b, cap, hkv, d)), jnp.bfloat16) for _ in range(2))
            table = None
        else:
            pages = -(-cap // page_size)
            k, v = (jnp.asarray(rng.standard_normal((b * pages, page_size, hkv, d)), jnp.bfloat16) for _ in range(2))
            table = jnp.asarray(rng.permutation(b * pages).reshape(b, pages), jnp.int32)
        f = jax.jit(lambda q, k, v, n, t: jax_flash.decode_attention(q, k, v, n, page_table=t, num_splits=splits,
                                                                     **kw))
        out = f(q, k, v, lengths, table)
        # traced out-of-range values are clamped: nothing outside the caches is read
        bad_n = lengths.at[-1].set(10**6)
        bad_t = None if table is None else table.at[0, 0].set(-5).at[-1, -1].set(10**6)
        out_bad = f(q, k, v, bad_n, bad_t)
        print(f"decode ({kernel}) B={b} Tq={tq} Hq={hq} Hkv={hkv} D={d} cap={cap} pages={page_size} splits={splits}: "
              f"finite={bool(jnp.isfinite(out.astype(jnp.float32)).all())} "
              f"clamped_ok={bool(jnp.isfinite(out_bad.astype(jnp.float32)).all())}", flush=True)


def segment_ops():
    """The segment-operands target alone: packings as runs (several positions per thread of the runs kernel), ids in
    any order, more runs than the runs limit, a side longer than the metadata kernel's staging tile."""
    from jax_flash import _ffi

    rng = np.random.default_rng(2)
    packed = np.searchsorted(np.sort(rng.choice(5000, 40, replace=False)), np.arange(5000), side="right")
    cases = [(np.stack([packed, packed[::-1]]), np.stack([packed, packed])),
             (rng.integers(0, 3, (2, 77)), rng.integers(0, 3, (2, 150))),
             (np.arange(_ffi.MAX_SEGMENT_RUNS + 5)[None], np.arange(3000)[None]),
             (np.sort(rng.integers(0, 50, (1, 40000))), np.sort(rng.integers(0, 50, (1, 70)))),
             (np.stack([packed, packed[::-1]]), None)]  # None: one array for both sides (the runs kernel's one-side path)
    for q_ids, kv_ids in cases:
        q = jnp.asarray(q_ids, jnp.int32)
        kv = q if kv_ids is None else jnp.asarray(kv_ids, jnp.int32)
        out = jax.block_until_ready(_ffi.segment_operands(q, kv))
        print(f"segment_operands {q.shape} {kv.shape}: runs taken {(np.asarray(out[2])[:, 0, 0] >= 0).tolist()}",
              flush=True)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="small calls for compute-sanitizer")
    ap.add_argument("--decode-only", action="store_true", help="skip the attention calls")
    ap.add_argument("--segment-ops-only", action="store_true", help="only the segment-operands target")
    ap.add_argument("--cases", default=":", metavar="START:STOP",
                    help="a slice of the attention calls (CASES on the default kernels, then the last three forced "
                         "onto the sm_80-class ones)")
    ap.add_argument("--decode-kernel", choices=("auto", "decode-cp-async", "sm80"), action="append",
                    help="decode kernels to run (default all three; repeatable)")
    ap.add_argument("--decode-cases", default=":", metavar="START:STOP",
                    help="a slice of DECODE_CASES (racecheck in several smaller processes)")
    a = ap.parse_args()

    def cut(text):
        start, stop = (int(x) if x else None for x in text.split(":"))
        return slice(start, stop)

    if a.segment_ops_only:
        segment_ops()
        raise SystemExit
    if not a.decode_only:
        main(cut(a.cases))
    decode(tuple(a.decode_kernel or ("auto", "decode-cp-async", "sm80")), cut(a.decode_cases))
