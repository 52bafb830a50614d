"""Where a decode call's time goes inside benchmarks/bench_decode.py's program timing: runs its chained program
(--calls calls, each call's query the previous call's output) under JAX's profiler (CUPTI) and prints, per
implementation, the GPU's kernels of one program with their durations and the idle gaps between them, then per
call: the program's span, the kernels' busy time and the gaps, beside bench_decode's wall-clock time per call
(`--timing program`) for the same program (its default on a GPU, `--timing device`, is the traced span). Nsight
Systems is not on the GPU machines; Nsight Compute serialises kernels, so it shows no gaps.

    python3 tools/timeline_decode.py --impls jax_flash,cudnn --batch 8 --seqlen 32768 --tq 1 [--out DIR]
    (--page-size 16: a paged cache, the pool's pages in shuffled order)
"""

import argparse
import json
import os
import runpy
import statistics
import types

import jax


def _tool(name):
    """A module's functions, loaded from this directory (tools are scripts, not a package)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return types.SimpleNamespace(**runpy.run_path(os.path.join(here, name)))


def _bench():
    """benchmarks/bench_decode.py's functions."""
    return _tool(os.path.join("..", "benchmarks", "bench_decode.py"))


def split_programs(events, gap_ns):
    """The events grouped into programs: a new program starts after an idle gap longer than gap_ns."""
    programs, cur, end = [], [], None
    for ev in events:
        if cur and ev[0] - end > gap_ns:
            programs.append(cur)
            cur = []
        end = max(end, ev[1]) if cur else ev[1]
        cur.append(ev)
    if cur:
        programs.append(cur)
    return programs


def summarise(program, calls):
    span = max(e for _, e, _ in program) - program[0][0]
    busy, end = 0, program[0][0]
    for s, e, _ in program:  # union of the kernels' intervals
        busy += max(0, e - max(s, end))
        end = max(end, e)
    return dict(kernels=len(program), span_us=span / 1e3 / calls, busy_us=busy / 1e3 / calls,
                gaps_us=(span - busy) / 1e3 / calls)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="jax_flash,cudnn")
    profile = _tool("profile_decode.py")
    profile.add_shape_args(ap, tq=1)
    ap.add_argument("--calls", type=int, default=10, help="calls chained in one program (bench_decode's --calls)")
    ap.add_argument("--programs", type=int, default=3, help="programs profiled (the median one is listed)")
    ap.add_argument("--back-to-back", type=int, default=5,
                    help="programs enqueued back to back and profiled as one run (bench_decode's repetitions)")
    ap.add_argument("--out", default=None, help="directory for timeline-<shape>.json")
    a = ap.parse_args()
    bench = _bench()
    q, k, v, n, table = profile.decode_inputs(a)
    caches = bench._cache_copies(k, v, "program", a.calls)
    splits = bench._ffi.decode_splits(q.shape, a.kv_heads, a.seqlen, table is not None)
    shape = (f"{a.heads}/{a.kv_heads}x{a.head_dim} Tq{a.tq} B{a.batch} S{a.seqlen}"
             f"{' ragged' if a.ragged else ''}{f' paged{a.page_size}' if a.page_size else ''}")
    results = []
    for impl in a.impls.split(","):
        fn, why = bench.implementations(impl, a.tq, f"paged{a.page_size}" if a.page_size else "dense", splits,
                                        ragged=a.ragged)
        if fn is None:
            print(f"## {impl} {shape}: does not run ({why})")
            continue
        us, _ = bench._time_us(fn, q, caches, n, table, a.calls, 5, "program")
        run = jax.jit(bench._chained(fn, a.calls))
        jax.block_until_ready(run(q, caches, n, table))
        events = bench.traced_gpu_events(
            lambda: [jax.block_until_ready(run(q, caches, n, table)) for _ in range(a.programs)])
        # --timing program's pattern: programs enqueued back to back, one wait
        b2b = bench.traced_gpu_events(
            lambda: jax.block_until_ready([run(q, caches, n, table) for _ in range(a.back_to_back)]))
        programs = [p for p in split_programs(events, 20_000) if len(p) >= a.calls]
        if not programs:
            print(f"## {impl} {shape}: no GPU events traced ({len(events)} events)")
            continue
        stats = [summarise(p, a.calls) for p in programs]
        mid = sorted(range(len(stats)), key=lambda i: stats[i]["span_us"])[len(stats) // 2]
        prog, st = programs[mid], stats[mid]
        print(f"## {impl} {shape}: bench_decode {us:.1f} us per call; traced program (median of {len(stats)}): "
              f"span {st['span_us']:.1f} us per call = kernels {st['busy_us']:.1f} + idle {st['gaps_us']:.1f}; "
              f"{st['kernels']} kernels in {a.calls} calls")
        kinds = {}
        prev_end = None
        for i, (s, e, name) in enumerate(prog):
            gap = 0 if prev_end is None else (s - prev_end) / 1e3
            prev_end = e if prev_end is None else max(prev_end, e)
            k_ = kinds.setdefault(name, [0, 0.0, 0.0])
            k_[0] += 1
            k_[1] += (e - s) / 1e3
            k_[2] += gap
            if i < 2 * len(prog) // a.calls + 1:  # the first two calls in full
                print(f"    +{gap:7.1f} gap  {(e - s) / 1e3:8.1f} us  {name[:110]}")
        print("  per kernel name (count, device us, idle us before it), whole program:")
        for name, (c, dur, gap) in sorted(kinds.items(), key=lambda kv_: -kv_[1][1]):
            print(f"    {c:4d} x  {dur / c:8.1f} us  idle {gap / c:6.1f} us before  {name[:100]}")
        if b2b:
            whole = summarise(b2b, a.calls * a.back_to_back)
            idle = sorted(((s_ - e_) / 1e3 for (_, e_, _), (s_, _, _) in zip(b2b, b2b[1:]) if s_ - e_ > 5_000),
                          reverse=True)
            print(f"  {a.back_to_back} programs back to back: span {whole['span_us']:.1f} us per call = kernels "
                  f"{whole['busy_us']:.1f} + idle {whole['gaps_us']:.1f}; idle stretches > 5 us: "
                  f"{[round(x, 1) for x in idle[:12]]}")
            longest = max(kinds, key=lambda n_: kinds[n_][1])
            durs = [(e_ - s_) / 1e3 for s_, e_, n_ in b2b if n_ == longest]
            print(f"    its longest kernel: mean {statistics.mean(durs):.1f} us over {len(durs)} (single programs: "
                  f"{kinds[longest][1] / kinds[longest][0]:.1f})")
            results_b2b = whole
        else:
            results_b2b = None
        results.append(dict(impl=impl, shape=shape, bench_us=us, **st, back_to_back=results_b2b,
                            spans=[s_["span_us"] for s_ in stats],
                            by_kernel={n_: dict(count=c, mean_us=dur / c, mean_gap_us=gap / c)
                                       for n_, (c, dur, gap) in kinds.items()}))
        print(f"  spans per call over the profiled programs: {[round(s_['span_us'], 1) for s_ in stats]}"
              f" (median {statistics.median([s_['span_us'] for s_ in stats]):.1f})")
    if a.out and results:
        os.makedirs(a.out, exist_ok=True)
        name = shape.replace("/", "-").replace(" ", "_")
        with open(os.path.join(a.out, f"timeline-{name}.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
