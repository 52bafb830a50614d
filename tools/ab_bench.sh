#!/usr/bin/env bash
# Timing A/B between builds, in one device call. Each wheel in dist/<name>/ is installed to /tmp/jf_<name>; every
# round runs bench_attention.py under each build in turn on SHAPES, starting one build later each round (so no build
# always runs first, on a cooler GPU), cuDNN in the round's first run as a clock reference; then prints per shape the
# median over rounds of each build's forward (and backward) time, its ratio to the first build, and per build the
# geometric mean of those ratios (also in $OUT/ab_summary.txt; the per-run tables in $OUT/ab.tgz).
#   bash tools/ab_bench.sh "nameA nameB ..." SHAPES [ROUNDS=2] [extra bench_attention.py flags]
# SHAPES as bench_attention.py --shapes takes them (BxSxHq[/Hkv]xD[c], comma-separated); with
# --impls jax_flash,jax_flash+softcap (say) each variant is a row of its own. One build's run longer than
# RUN_LIMIT seconds (default 200: an experimental kernel that hangs) is stopped and the rest go on. A build whose
# dist/<name>/env exists runs with its lines (NAME=value) in the environment (one wheel's run-time variants).
# Each row is timed for at least 0.5 s: one wheel A/B'd against itself (3 rounds, H100) read +-3 % per shape at 0.15 s
# and within +-0.8 % at 0.5 s (NOTES, session 49).
set -uo pipefail
cd "$(dirname "$0")/.."
names=$1; shapes=$2; rounds=${3:-2}; shift $(( $# < 3 ? $# : 3 ))
OUT=${OUT:-$PWD/ab_out}
root=$PWD
mkdir -p "$OUT/ab"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
for n in $names; do
  rm -rf "/tmp/jf_$n"  # pip --target keeps an existing package (a warm machine)
  python3 -m pip install -q --no-index --no-deps --target "/tmp/jf_$n" "dist/$n"/*.whl 2>&1 | grep -v WARNING
done
read -r -a builds <<<"$names"
nb=${#builds[@]}
for r in $(seq 1 "$rounds"); do
  first=1
  for i in $(seq 0 $((nb - 1))); do
    n=${builds[$(((i + r - 1) % nb))]}
    impls=jax_flash; [ $first = 1 ] && impls=jax_flash,cudnn; first=0
    t0=$SECONDS
    envs=(); [ -f "dist/$n/env" ] && mapfile -t envs <"dist/$n/env"
    (cd /tmp && env "${envs[@]}" PYTHONPATH="/tmp/jf_$n" timeout "${RUN_LIMIT:-200}" python3 "$root/benchmarks/bench_attention.py" --impls $impls --shapes "$shapes" \
        --iters 10 --min-time 0.5 --ref-heads 1 --out "$OUT/ab" --name "$n-r$r" "$@" >"/tmp/ab_$n-r$r.log" 2>&1) ||
      tail -5 "/tmp/ab_$n-r$r.log"
    echo "round $r $n: $((SECONDS - t0)) s"
  done
done
python3 - "$OUT/ab" $names <<'PY' | tee "$OUT/ab_summary.txt"
import glob, json, math, statistics, sys
d, names = sys.argv[1], sys.argv[2:]
t = {}  # shape -> build (or "cudnn") -> [(fwd_ms, bwd_ms, rel_err) per round]
for path in sorted(glob.glob(f"{d}/*-r*.json")):
    build = path.split("/")[-1].rsplit("-r", 1)[0]
    for r in json.load(open(path))["rows"]:
        if r["error"] or not (r["impl"] == "cudnn" or r["impl"].startswith("jax_flash")):
            continue  # other peers (--impls ...) are not builds
        variant = r["impl"][len("jax_flash"):] if r["impl"].startswith("jax_flash+") else ""  # e.g. +softcap
        key = (r["B"], r["Sq"], r["Hq"], r["Hkv"], r["D"], r["causal"], variant)
        who = "cudnn" if r["impl"] == "cudnn" else build
        t.setdefault(key, {}).setdefault(who, []).append((r["fwd_ms"], r["bwd_ms"], r["rel_err"]))
cols = names + ["cudnn"]
w = 38
print("median ms over rounds: fwd[/bwd], then first build's time / this one's (fwd[/bwd]); err = fwd rel. error")
print(f"{'shape':<28}" + "".join(f"{c:>{w}}" for c in cols))
med = statistics.median
ratios = {n: ([], []) for n in cols}  # build -> (fwd ratios, bwd ratios) over shapes
for key, by in t.items():
    b, s, hq, hkv, dd, c, variant = key
    label = f"{b}x{s}x{hq}{'' if hq == hkv else '/' + str(hkv)}x{dd}{'c' if c else ''}{variant}"
    base = by.get(names[0])
    base_f = med(x[0] for x in base) if base else float("nan")
    base_b = [x[1] for x in base if x[1] is not None] if base else []
    cells = []
    for n in cols:
        if n not in by:
            cells.append(f"{'-':>{w}}"); continue
        f = med(x[0] for x in by[n])
        bw = [x[1] for x in by[n] if x[1] is not None]
        txt = f"{f:.3f}" + (f"/{med(bw):.3f}" if bw else "") + f" x{base_f / f:.3f}"
        ratios[n][0].append(base_f / f)
        if bw and base_b:
            txt += f"/{med(base_b) / med(bw):.3f}"
            ratios[n][1].append(med(base_b) / med(bw))
        cells.append(f"{txt + f' e{by[n][0][2]:.0e}':>{w}}")
    print(f"{label:<28}" + "".join(cells))
geo = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")
print(f"{'geomean':<28}" + "".join(
    f"{'x%.3f' % geo(ratios[n][0]) + ('/%.3f' % geo(ratios[n][1]) if ratios[n][1] else ''):>{w}}" for n in cols))
PY
(cd "$OUT" && tar czf ab.tgz ab && rm -rf ab)  # one file back instead of three per build and round
