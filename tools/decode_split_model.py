"""Model of the decode kernels' balanced splits (FlashParams::balance_splits) over ragged batches: greedy list
scheduling of the split blocks in launch order on the GPU's resident-block slots.

For a batch of B sequences of random lengths (uniform in [1, S], as bench_decode.py's ragged rows) and Hkv kv heads,
with `per_sm` resident blocks per SM (from the kernel's shared memory and threads, jax_flash._ffi.decode_splits):
the equal split count fills one wave, the grid holds twice it, and each sequence takes ceil(tiles_b / share) blocks
of about `share` 64-key tiles (head dim 256 has 32-key tiles: the same with S doubled). Two rules for the share:
"first" (ceil(total / target), target = B x splits per kv head: session 18's v7) and "fit" (raised, at most four
times, until the rounded-up counts fit the target: dec15); where the equal count is below two, one split per
sequence ("one"). Two launch orders: the grid's ("batch") and longest-first ("lpt": the batch elements sorted by
their blocks' tiles, descending). The packed-row bound on splits is left out. Work per block = its
tiles; blocks start in launch order on the first free slot. Prints the mean active blocks per slot and the makespan
over the perfectly balanced one (mean and 90th percentile over `--trials` draws).
A model, not a measurement: blocks run at one speed however many share the memory system (a memory-bound tail runs
faster than this says), and the kernel's fixed costs are left out.

    python3 tools/decode_split_model.py 8x32768x8:4 8x32768x8:1 64x8192x1:4
"""
import argparse
import heapq
import re

import numpy as np


def schedule(batch, heads_kv, seqlen, per_sm, sms, rule, order, rng):
    slots = per_sm * sms
    equal = max(1, min(slots // (batch * heads_kv), seqlen // 128, 256))
    num_splits = min(2 * equal, 1024) if equal >= 2 else 1  # decode_split_plan: no balancing below two splits
    tiles = -(-rng.integers(1, seqlen + 1, size=batch) // 64)
    target = max(batch * num_splits // 2, 1)
    share = max(-(-int(tiles.sum()) // target), 1)
    splits_of = lambda share: np.minimum(num_splits, np.maximum(-(-tiles // share), 1))  # noqa: E731
    if num_splits == 1:
        share = int(tiles.max())
    elif rule == "fit":
        for _ in range(4):
            count = int(splits_of(share).sum())
            if count <= target:
                break
            share = max(share + 1, -(-share * count // target))
    splits = splits_of(share)
    per = -(-tiles // splits)
    # Launch order of the grid (split fastest, then kv head, then batch element: "batch"; or the batch elements by
    # their split's tiles, most first: "lpt"); empty splits take no slot time.
    elements = range(batch) if order == "batch" else sorted(range(batch), key=lambda b: -per[b])
    work = [min(per[b], tiles[b] - i * per[b]) for b in elements for _ in range(heads_kv)
            for i in range(splits[b]) if tiles[b] > i * per[b]]
    finish = [0] * slots
    for w in work:
        heapq.heappush(finish, heapq.heappop(finish) + w)
    return len(work) / slots, max(finish) / (tiles.sum() * heads_kv / slots)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", help="BxSxHkv:blocks_per_SM (e.g. 8x32768x8:4)")
    parser.add_argument("--sms", type=int, default=132, help="SMs (H100 / H200 SXM: 132)")
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args()
    print(f"{'shape':<16} {'rule/order':<10} {'active/slots':>12} {'makespan/ideal':>15} {'p90':>6}")
    for shape in args.shapes:
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+):(\d+)", shape)
        if not m:
            parser.error(f"shape {shape!r}: expected BxSxHkv:blocks_per_SM")
        b, s, hkv, per_sm = (int(x) for x in m.groups())
        if b < 2:
            print(f"{shape:<16} one sequence: no balancing")
            continue
        one = min(per_sm * args.sms // (b * hkv), s // 128, 256) < 2
        for rule, order in ([("one", "batch"), ("one", "lpt")] if one else
                            [("first", "batch"), ("fit", "batch"), ("fit", "lpt")]):
            rng = np.random.default_rng(0)
            runs = np.array([schedule(b, hkv, s, per_sm, args.sms, rule, order, rng) for _ in range(args.trials)])
            print(f"{shape:<16} {rule + '/' + order:<10} {runs[:, 0].mean():>12.2f} {runs[:, 1].mean():>15.2f} "
                  f"{np.percentile(runs[:, 1], 90):>6.2f}")


if __name__ == "__main__":
    main()
