#!/usr/bin/env bash
# Timing A/B between builds, in one device call. Each wheel in dist/<name>/ is installed to /tmp/jf_<name>; every
# round runs bench_attention.py under each build in turn (cuDNN once per round, as a clock reference) on SHAPES,
# then prints per shape the median over rounds of each build's time and its ratio to the first build (also in
# $OUT/ab_summary.txt; the per-run tables in $OUT/ab.tgz).
#   bash benchmarks/ab_bench.sh "nameA nameB ..." SHAPES [ROUNDS=2] [extra bench_attention.py flags]
# SHAPES as bench_attention.py --shapes takes them (BxSxHq[/Hkv]xD[c], comma-separated). One build's run longer than
# RUN_LIMIT seconds (default 200: an experimental kernel that hangs) is stopped and the rest go on.
set -uo pipefail
cd "$(dirname "$0")/.."
names=$1; shapes=$2; rounds=${3:-2}; shift $(( $# < 3 ? $# : 3 ))
OUT=${OUT:-$PWD/ab_out}
root=$PWD
mkdir -p "$OUT/ab"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
for n in $names; do
  python3 -m pip install -q --no-index --no-deps --target "/tmp/jf_$n" "dist/$n"/*.whl 2>&1 | grep -v WARNING
done
for r in $(seq 1 "$rounds"); do
  first=1
  for n in $names; do
    impls=jax_flash; [ $first = 1 ] && impls=jax_flash,cudnn; first=0
    t0=$SECONDS
    (cd /tmp && PYTHONPATH="/tmp/jf_$n" timeout "${RUN_LIMIT:-200}" python3 "$root/benchmarks/bench_attention.py" --impls $impls --shapes "$shapes" \
        --iters 10 --min-time 0.15 --ref-heads 1 --out "$OUT/ab" --name "$n-r$r" "$@" >"/tmp/ab_$n-r$r.log" 2>&1) ||
      tail -5 "/tmp/ab_$n-r$r.log"
    echo "round $r $n: $((SECONDS - t0)) s"
  done
done
python3 - "$OUT/ab" $names <<'PY' | tee "$OUT/ab_summary.txt"
import glob, json, statistics, sys
d, names = sys.argv[1], sys.argv[2:]
t = {}  # shape -> build (or "cudnn") -> [(fwd_ms, bwd_ms, rel_err) per round]
for path in sorted(glob.glob(f"{d}/*-r*.json")):
    build = path.split("/")[-1].rsplit("-r", 1)[0]
    for r in json.load(open(path))["rows"]:
        if r["error"]:
            continue
        key = (r["B"], r["Sq"], r["Hq"], r["Hkv"], r["D"], r["causal"])
        who = "cudnn" if r["impl"] == "cudnn" else build
        t.setdefault(key, {}).setdefault(who, []).append((r["fwd_ms"], r["bwd_ms"], r["rel_err"]))
cols = names + ["cudnn"]
print("median ms over rounds (fwd[/bwd]); x = first build's time / this one's; err = forward rel. error")
print(f"{'shape':<26}" + "".join(f"{c:>26}" for c in cols))
for key, by in t.items():
    b, s, hq, hkv, dd, c = key
    label = f"{b}x{s}x{hq}{'' if hq == hkv else '/' + str(hkv)}x{dd}{'c' if c else ''}"
    base = statistics.median(x[0] for x in by.get(names[0], [(float('nan'),) * 3]))
    cells = []
    for n in cols:
        if n not in by:
            cells.append(f"{'-':>26}"); continue
        f = statistics.median(x[0] for x in by[n])
        bw = [x[1] for x in by[n] if x[1] is not None]
        err = by[n][0][2]
        txt = f"{f:.3f}" + (f"/{statistics.median(bw):.3f}" if bw else "") + f" x{base / f:.3f} e{err:.0e}"
        cells.append(f"{txt:>26}")
    print(f"{label:<26}" + "".join(cells))
PY
(cd "$OUT" && tar czf ab.tgz ab && rm -rf ab)  # one file back instead of three per build and round
