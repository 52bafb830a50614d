#!/usr/bin/env bash
# Profile one jax_flash kernel with Nsight Compute (clocks as found) and export its per-instruction source view:
#   bash tools/ncu_kernel.sh KERNEL_REGEX [profile_one.py args...]   (SCRIPT=tools/profile_decode.py: a decode call)
# Writes $OUT/<name>.ncu-rep, $OUT/<name>-details.txt, $OUT/<name>-raw.csv (every metric) and $OUT/<name>-sass.csv
# (name: $NAME, else from KERNEL_REGEX).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/ncu_out}
mkdir -p "$OUT"
regex=$1
shift
name=${NAME:-$(echo "$regex" | tr -c 'A-Za-z0-9_\n' '_')}
(cd /tmp && ncu -f --clock-control none --set full --import-source yes -k "regex:$regex" -c 1 -o "$OUT/$name" \
  python3 "$OLDPWD/${SCRIPT:-tools/profile_one.py}" "$@") >"$OUT/$name-run.log" 2>&1 || { tail -20 "$OUT/$name-run.log"; exit 1; }
ncu -i "$OUT/$name.ncu-rep" --page details >"$OUT/$name-details.txt" 2>&1
ncu -i "$OUT/$name.ncu-rep" --page raw --csv >"$OUT/$name-raw.csv" 2>&1
ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/$name-sass.csv" 2>&1
grep -E "^  [a-z]|Duration|Registers Per|Local Memory Spilling Requests |Issued Ipc|No Eligible" "$OUT/$name-details.txt"
