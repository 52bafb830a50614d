"""Model of the sm_90a backward's last-wave tail: greedy list scheduling of its CTAs in launch order.

Each CTA owns one key block (128 keys at head dim <= 128) of one (batch, kv head) and walks the 64-row query
tiles that see it, for every query head of its group; the hardware starts CTAs in linear order on whichever SM
frees up first (one CTA per SM). Work per CTA = tiles walked + a fixed overhead (prologue, epilogue) in tiles.
Prints the modelled makespan of the two grid orders (key blocks fastest, the grid before
`cuda/kernels/tile_scheduler_bwd.cuh`; key blocks slowest, the grid with it) against the perfectly balanced one.
A model, not a measurement: it ignores per-SM speed differences, L2 effects and the dispatch's own latency.

    python3 benchmarks/bwd_schedule_model.py 2x4096x32/8c 4x4096x16c 1x16384x16
"""
import argparse
import heapq
import re


def makespan(work, order, sms):
    finish = [0.0] * sms
    for cta in order:
        heapq.heappush(finish, heapq.heappop(finish) + work[cta])
    return max(finish)


def model(batch, seqlen, heads_q, heads_kv, causal, sms, overhead, block_n=128, block_m=64):
    group = heads_q // heads_kv
    key_blocks = -(-seqlen // block_n)
    query_tiles = -(-seqlen // block_m)

    def tiles(n):  # query tiles that see key block n (causal: rows from the block's first key on)
        return query_tiles - (n * block_n) // block_m if causal else query_tiles

    work = {(n, h, b): group * tiles(n) + overhead
            for n in range(key_blocks) for h in range(heads_kv) for b in range(batch)}
    keys_fastest = [(n, h, b) for b in range(batch) for h in range(heads_kv) for n in range(key_blocks)]
    keys_slowest = [(n, h, b) for n in range(key_blocks) for b in range(batch) for h in range(heads_kv)]
    ideal = sum(work.values()) / sms
    return makespan(work, keys_fastest, sms), makespan(work, keys_slowest, sms), ideal


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", help="BxSxHq[/Hkv][c], c = causal (e.g. 2x4096x32/8c)")
    parser.add_argument("--sms", type=int, default=132, help="SMs (H100 SXM: 132)")
    parser.add_argument("--overhead", type=float, default=3.0, help="per-CTA overhead in query tiles")
    args = parser.parse_args()
    print(f"{'shape':<16} {'keys fastest':>12} {'keys slowest':>12} {'ideal':>8} {'gain':>7}")
    for shape in args.shapes:
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:/(\d+))?(c?)", shape)
        if not m:
            parser.error(f"shape {shape!r}: expected BxSxHq[/Hkv][c]")
        b, s, hq = int(m[1]), int(m[2]), int(m[3])
        hkv = int(m[4]) if m[4] else hq
        if hq % hkv:
            parser.error(f"shape {shape!r}: Hq must be a multiple of Hkv")
        old, new, ideal = model(b, s, hq, hkv, bool(m[5]), args.sms, args.overhead)
        print(f"{shape:<16} {old:>12.0f} {new:>12.0f} {ideal:>8.0f} {100 * (old / new - 1):>6.1f}%")


if __name__ == "__main__":
    main()
