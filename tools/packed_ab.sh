#!/usr/bin/env bash
# Timing A/B of builds on benchmarks/bench_packed.py's tables, in one device call: each wheel in dist/<name>/ is
# installed to /tmp/jf_<name>; every round runs bench_packed.py (TABLES, default the packed table) under each build
# in turn, one build later each round; then prints per row the median over rounds of each build's time and its ratio
# to the first build (also in $OUT/packed_ab.txt; the per-run tables under $OUT/runs/).
#   OUT=... [WHEEL_PYTHON="main" | 1] bash tools/packed_ab.sh "nameA nameB" [ROUNDS=2] [extra bench_packed.py flags]
set -uo pipefail
cd "$(dirname "$0")/.."
names=$1; rounds=${2:-2}; shift $(( $# < 2 ? $# : 2 ))
OUT=${OUT:-$PWD/packed_ab_out}
root=$PWD
mkdir -p "$OUT/runs"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
for n in $names; do
  rm -rf "/tmp/jf_$n"  # pip --target keeps an existing package (a warm machine)
  python3 -m pip install -q --no-index --no-deps --target "/tmp/jf_$n" "dist/$n"/*.whl 2>&1 | grep -v WARNING
  # The working tree's Python over each build's (tools/python_overlay.sh: but for the files a pending build's
  # patches change), except for the builds named in WHEEL_PYTHON (or all with WHEEL_PYTHON=1), which keep their
  # wheel's own (builds whose Python and FFI differ).
  case " ${WHEEL_PYTHON:-} " in
    " 1 " | *" $n "*) ;;
    *) bash tools/python_overlay.sh "$n" "/tmp/jf_$n/jax_flash" ;;
  esac
done
read -r -a builds <<<"$names"
nb=${#builds[@]}
for r in $(seq 1 "$rounds"); do
  for i in $(seq 0 $((nb - 1))); do
    n=${builds[$(((i + r - 1) % nb))]}
    t0=$SECONDS
    (cd /tmp && PYTHONPATH="/tmp/jf_$n" timeout "${RUN_LIMIT:-300}" python3 "$root/benchmarks/bench_packed.py" \
      --tables "${TABLES:-packed}" --out "$OUT/runs" --name "$n-r$r" "$@" >"$OUT/runs/$n-r$r.log" 2>&1) ||
      tail -5 "$OUT/runs/$n-r$r.log"
    echo "round $r $n: $((SECONDS - t0)) s"
  done
done
python3 - "$OUT/runs" $names <<'PY' | tee "$OUT/packed_ab.txt"
import glob, json, math, statistics, sys
d, names = sys.argv[1], sys.argv[2:]
t = {}  # (table, lengths / causal, impl, column) -> build -> [ms per round]
for n in names:
    for path in sorted(glob.glob(f"{d}/{n}-r*.json")):
        for row in json.load(open(path))["rows"]:
            key = (row["table"], row.get("doc_lengths", row.get("causal")), row["impl"])
            for col in ("ms", "fwd_ms", "bwd_ms"):
                if col in row:
                    t.setdefault(key + (col,), {}).setdefault(n, []).append(row[col])
print("median ms over rounds; ratio = first build's time / this build's (>1: faster)")
logs = {n: [] for n in names[1:]}
for key, by in t.items():
    med = {n: statistics.median(v) for n, v in by.items()}
    base = med.get(names[0])
    cells = []
    for n in names:
        if n not in med:
            cells.append(f"{n} -")
            continue
        ratio = base / med[n] if base else float("nan")
        if n != names[0] and base and key[3] == "ms" and key[2].startswith("jax_flash"):
            logs[n].append(math.log(ratio))
        cells.append(f"{n} {med[n]:.3f}" + (f" ({ratio:.3f})" if n != names[0] else ""))
    print(" | ".join(str(k) for k in key) + " | " + " | ".join(cells))
for n, v in logs.items():
    if v:
        print(f"{n}: geometric mean ratio over jax_flash rows (fwd + bwd) {math.exp(sum(v) / len(v)):.3f} (n={len(v)})")
PY
