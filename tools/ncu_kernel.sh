#!/usr/bin/env bash
# Profile one jax_flash kernel with Nsight Compute (clocks as found) and export its per-instruction source view:
#   bash tools/ncu_kernel.sh KERNEL_REGEX [profile_one.py args...]   (SCRIPT=tools/profile_decode.py: a decode call)
# Writes $OUT/<name>.ncu-rep, $OUT/<name>-details.txt, $OUT/<name>-raw.csv (every metric), $OUT/<name>-stalls.csv
# (its stall, pipe and DRAM metrics) and $OUT/<name>-sass.csv (name: $NAME, else from KERNEL_REGEX). Kernel names
# are matched demangled (template arguments included: "FlashAttnFwdSm90" finds FlashAttention-3's forward).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/ncu_out}
mkdir -p "$OUT"
regex=$1
shift
name=${NAME:-$(echo "$regex" | tr -c 'A-Za-z0-9_\n' '_')}
(cd /tmp && ncu -f --clock-control none --set full --import-source yes --kernel-name-base demangled \
  -k "regex:$regex" -c 1 -o "$OUT/$name" \
  python3 "$OLDPWD/${SCRIPT:-tools/profile_one.py}" "$@") >"$OUT/$name-run.log" 2>&1 || { tail -20 "$OUT/$name-run.log"; exit 1; }
ncu -i "$OUT/$name.ncu-rep" --page details >"$OUT/$name-details.txt" 2>&1
ncu -i "$OUT/$name.ncu-rep" --page raw --csv >"$OUT/$name-raw.csv" 2>&1
ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/$name-sass.csv" 2>&1
grep -E "^  [a-z]|Duration|Registers Per|Local Memory Spilling Requests |Issued Ipc|No Eligible" "$OUT/$name-details.txt"
# the stall reasons (per issued instruction) and pipe activity, from the raw page
python3 - "$OUT/$name-raw.csv" >"$OUT/$name-stalls.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
for name, unit, value in zip(rows[head], rows[head + 1], rows[head + 2]):
    if "stall" in name or "pipe" in name or "inst_executed" in name or "dram__" in name:
        print(f"{name},{unit},{value}")
PY
