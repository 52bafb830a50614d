"""Model of the last-wave tail of a grid of one CTA per unit of work: greedy list scheduling in launch order.

The hardware starts CTAs in linear order on whichever SM frees up first (one CTA per SM here). Backward (the
sm_90a kernel at head dim <= 128): a CTA owns one 128-key block of one (batch, kv head) and walks the 64-row query
tiles that see it, for every query head of its group. Forward (the CTA-per-unit kernel at head dim 256): a CTA owns
one 128-row query block and walks the 64-key tiles it sees. Work per CTA = tiles walked + a fixed overhead in tiles.
Prints the modelled makespan of four orders against the perfectly balanced one: blocks fastest (heaviest first
inside each head, heads one after another: the backward's grid, and the d256 forward's with few blocks per head),
blocks slowest over all heads, HeavyFirstOrder's groups of about --group-units units
(`cuda/kernels/sm90/tile_scheduler_fwd.cuh`, the d256 causal forward with >= 16 query blocks per head), and the
persistent backward's causal order (`tile_scheduler_bwd.cuh`: blocks fastest, but the last heads, about
--tail-waves units per SM, blocks slowest), and that tail sorted heaviest first (an order tried for segment-id
calls and dropped: 1.9 % slower on an H100 although modelled faster, NOTES session 41). The persistent backward
takes units from a counter, which the same list scheduling models (a CTA takes the next unit when it is done with
one). --docs N (backward, causal): every sequence packed from N equal
documents (segment ids), each key block seeing the query tiles of its own document only.
A model, not a measurement: it ignores per-SM speed differences, L2 effects and the dispatch's own latency; its
backward gains (+23..26 % for causal GQA) did not show on the H100 (session 10 A/B, NOTES.md), so the backward
kept its grid.

`rows` models a forward without a mask in units of one query block of --block-rows rows (work 1; a head's short
last block rows / block, at least --short-floor), head after head, each head's short block first (the persistent and
work-counter grids' order): a persistent grid's static round-robin (CTA c: units c, c + SMs, ...), the same
skewed one place a round (CTA c: unit k SMs + (c + k) mod SMs of round k, `PersistentWalk` with kSkewedRounds) and
list scheduling (a work counter), and with --last-split k the skewed whole rounds followed by the last round's
units in k parts over keys from a counter (`tail`); the gain is the static grid's over the best of the others. With
--split-tail C a head whose rows leave block / 3 over takes its last block and those rows as two blocks of 2/3
block rows, each costing C (session 63: variable-height tails). The short block's work as rows / block fits the
three-warpgroup tiles (a warpgroup past the rows computes nothing: the skew gained x1.05-1.14 on them where the
model said 9-33 %); on the two-warpgroup tiles a short block cost about a whole one (the skew gained nothing where
the model said 28 %, session 64), so model those with --short-floor 1.

    python3 tools/schedule_model.py bwd 2x4096x32/8c 4x4096x16c 1x16384x16
    python3 tools/schedule_model.py bwd 4x8192x16c --docs 8
    python3 tools/schedule_model.py fwd 4x4096x8c 2x8192x8c
    python3 tools/schedule_model.py rows 16x1024x16 32x512x16 4x4096x16 --block-rows 192 --split-tail 0.71
    python3 tools/schedule_model.py rows 4x4096x16 1x16384x16 --short-floor 0.609 --last-split 2
"""
import argparse
import heapq
import re


def makespan(work, order, sms):
    finish = [0.0] * sms
    for unit in order:
        heapq.heappush(finish, heapq.heappop(finish) + work[unit])
    return max(finish)


def heavy_first(blocks, heads, group_units):
    """(block rank, head) in the order of HeavyFirstOrder (tile_scheduler_fwd.cuh)."""
    group = min(heads, max(1, -(-group_units // blocks)))
    first = heads % group or group
    sizes = [first] + [group] * ((heads - first) // group)
    order, base = [], 0
    for size in sizes:
        order += [(j, base + r) for j in range(blocks) for r in range(size)]
        base += size
    return order


def tail_heads(blocks, heads, sms, waves):
    """The heads whose units BwdTileScheduler's causal order runs last, key block slowest."""
    return min(heads, -(-waves * sms // blocks)) if blocks > 1 else 0


def tail_order(blocks, heads, sms, waves):
    """(block rank, head) in BwdTileScheduler's causal order: the last heads key block slowest."""
    tail = tail_heads(blocks, heads, sms, waves)
    head = [(j, h) for h in range(heads - tail) for j in range(blocks)]
    return head + [(j, h) for j in range(blocks) for h in range(heads - tail, heads)]


def model(direction, batch, seqlen, heads_q, heads_kv, causal, sms, overhead, group_units, tail_waves, docs=1):
    if direction == "bwd":  # rank j = key block j; query tiles of 64 rows from the block's first key on
        blocks, heads, per_head = -(-seqlen // 128), batch * heads_kv, heads_q // heads_kv
        doc_blocks = -(-blocks // docs)  # key blocks per document (query tiles to its end)
        tiles = lambda j: per_head * (2 * doc_blocks - (2 * (j % doc_blocks) if causal else 0))
    else:  # rank j = query block blocks - 1 - j; key tiles of 64 keys up to the block's last row
        blocks, heads = -(-seqlen // 128), batch * heads_q
        tiles = lambda j: 2 * (blocks - j) if causal else 2 * blocks
    work = {(j, h): tiles(j) + overhead for j in range(blocks) for h in range(heads)}
    blocks_fastest = [(j, h) for h in range(heads) for j in range(blocks)]
    blocks_slowest = [(j, h) for j in range(blocks) for h in range(heads)]
    tail = tail_order(blocks, heads, sms, tail_waves)
    head = (heads - tail_heads(blocks, heads, sms, tail_waves)) * blocks
    sorted_tail = tail[:head] + sorted(tail[head:], key=lambda u: -work[u])  # stable: ties in tail order
    return (makespan(work, blocks_fastest, sms), makespan(work, blocks_slowest, sms),
            makespan(work, heavy_first(blocks, heads, group_units), sms), makespan(work, tail, sms),
            makespan(work, sorted_tail, sms), sum(work.values()) / sms)


def row_blocks(seqlen, block, short_floor, split_tail):
    """One head's query blocks without a mask, in the grids' order (the short last block first): their work."""
    full, rest = divmod(seqlen, block)
    if split_tail is not None and full >= 1 and 3 * rest == block:
        return [split_tail, split_tail] + [1.0] * (full - 1)
    return ([max(rest / block, short_floor)] if rest else []) + [1.0] * full


def rows_model(batch, seqlen, heads, sms, block, short_floor, split_tail, last_split=1, part_overhead=0.0):
    """(static round-robin, skewed round-robin, list-scheduling, split-tail makespans, mean) in full-block times.
    With last_split k > 1 the units past the last whole round each become k parts over keys of 1 / k of their work
    plus part_overhead (a forward last-round key split): the first three orders walk those parts like units; the
    split tail runs the whole rounds skewed and hands the parts out by list scheduling (a work counter after the
    walk: the dropped fwd-split-last-round.patch, git history 43e5a03; it gained less than modelled)."""
    work = [w for _ in range(batch * heads) for w in row_blocks(seqlen, block, short_floor, split_tail)]
    left = len(work) % sms
    whole = len(work) - left if last_split > 1 else len(work)  # the split tail's skewed walk, then its parts
    heap = [0.0] * sms
    for u, w in enumerate(work[:whole]):
        k, place = divmod(u, sms)
        heap[(place - k) % sms] += w
    heapq.heapify(heap)
    for w in work[whole:]:
        for _ in range(last_split):
            heapq.heappush(heap, heapq.heappop(heap) + w / last_split + part_overhead)
    tail_split = max(heap)
    if last_split > 1 and left:
        work = work[:len(work) - left] + [w / last_split + part_overhead for w in work[len(work) - left:]
                                          for _ in range(last_split)]
    static, skewed = [0.0] * sms, [0.0] * sms
    for u, w in enumerate(work):
        k, place = divmod(u, sms)
        static[place] += w
        skewed[(place - k) % sms] += w  # round k's place (c + k) mod sms is CTA c's
    return max(static), max(skewed), makespan(work, range(len(work)), sms), tail_split, sum(work) / sms


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("direction", choices=("fwd", "bwd", "rows"))
    parser.add_argument("shapes", nargs="+", help="BxSxHq[/Hkv][c], c = causal (e.g. 2x4096x32/8c)")
    parser.add_argument("--sms", type=int, default=132, help="SMs (H100 SXM: 132)")
    parser.add_argument("--overhead", type=float, default=3.0, help="per-CTA overhead in tiles")
    parser.add_argument("--group-units", type=int, default=512, help="HeavyFirstOrder's kHeavyFirstGroupUnits")
    parser.add_argument("--tail-waves", type=int, default=3, help="BwdTileScheduler::kTailWaves (kTailWavesGrouped with grouped query heads)")
    parser.add_argument("--docs", type=int, default=1, help="backward: equal documents packed per sequence")
    parser.add_argument("--block-rows", type=int, default=192, help="rows: query rows per block")
    parser.add_argument("--short-floor", type=float, default=0.5, help="rows: the least work of a short block")
    parser.add_argument("--split-tail", type=float, default=None, help="rows: cost of a 2/3-height tail block")
    parser.add_argument("--last-split", type=int, default=1, help="rows: parts over keys of each last-round unit")
    parser.add_argument("--part-overhead", type=float, default=0.04, help="rows: added work of each such part")
    args = parser.parse_args()
    if args.direction == "rows":
        print(f"{'shape':<14} {'static':>8} {'skewed':>8} {'counter':>8} {'tail':>8} {'mean':>8} {'gain':>6}")
        for shape in args.shapes:
            m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", shape)
            if not m:
                parser.error(f"shape {shape!r}: expected BxSxH (rows: no mask, no GQA)")
            static, skewed, counter, tail, mean = rows_model(
                int(m[1]), int(m[2]), int(m[3]), args.sms, args.block_rows, args.short_floor, args.split_tail,
                args.last_split, args.part_overhead)
            best = min(skewed, counter, tail)
            print(f"{shape:<14} {static:>8.2f} {skewed:>8.2f} {counter:>8.2f} {tail:>8.2f} {mean:>8.2f} "
                  f"{100 * (static / best - 1):>5.1f}%")
        return
    print(f"{'shape':<14} {'blocks fastest':>14} {'blocks slowest':>14} {'heavy-first':>11} {'tail':>8} "
          f"{'sorted tail':>11} {'ideal':>8} {'gain':>6} {'tail gain':>9}")
    for shape in args.shapes:
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:/(\d+))?(c?)", shape)
        if not m:
            parser.error(f"shape {shape!r}: expected BxSxHq[/Hkv][c]")
        b, s, hq = int(m[1]), int(m[2]), int(m[3])
        hkv = int(m[4]) if m[4] else hq
        if hq % hkv:
            parser.error(f"shape {shape!r}: Hq must be a multiple of Hkv")
        old, slowest, grouped, tail, sorted_tail, ideal = model(args.direction, b, s, hq, hkv, bool(m[5]), args.sms,
                                                                args.overhead, args.group_units, args.tail_waves,
                                                                args.docs)
        print(f"{shape:<14} {old:>14.0f} {slowest:>14.0f} {grouped:>11.0f} {tail:>8.0f} {sorted_tail:>11.0f} "
              f"{ideal:>8.0f} {100 * (old / grouped - 1):>5.1f}% {100 * (old / tail - 1):>8.1f}%")


if __name__ == "__main__":
    main()
