#!/usr/bin/env bash
# A/B of one kernel between builds, in one device call. Each wheel in dist/<name>/ is installed to /tmp/jf_<name>;
# for every line "tag profile_one.py-arguments" of SHAPES_FILE (default: three d128 forward shapes) Nsight Compute
# (clocks as found) profiles the first kernel matching REGEX under each build and prints its duration,
# instructions, IPC, L2 hit rate, DRAM bytes read and written, largest stall reasons and the busy share of the
# tensor, MUFU, FMA and ALU pipes and of DRAM; per-instruction SASS views and the details pages go to $OUT/sass.tgz.
#   bash tools/ncu_ab.sh REGEX "nameA nameB" [SHAPES_FILE]
set -uo pipefail
cd "$(dirname "$0")/.."
regex=$1
names=$2
shapes=${3:-}
OUT=${OUT:-$PWD/ncu_out}
mkdir -p "$OUT/csv"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
for n in $names; do
  rm -rf "/tmp/jf_$n"  # pip --target keeps an existing package (a warm machine)
  python3 -m pip install -q --no-index --no-deps --target "/tmp/jf_$n" "dist/$n"/*.whl 2>&1 | grep -v WARNING
done
default_shapes="s512 --batch 32 --seqlen 512 --heads 16 --head-dim 128
s4k --batch 4 --seqlen 4096 --heads 16 --head-dim 128
s16k --batch 1 --seqlen 16384 --heads 16 --head-dim 128"
while read -r tag args; do
  [ -z "$tag" ] && continue
  for n in $names; do
    name="${n}_$tag"
    PYTHONPATH="/tmp/jf_$n" NAME="$name" OUT=/tmp/ncu_ab bash tools/ncu_kernel.sh "$regex" $args >/dev/null ||
      { echo "$n $tag: profiling failed"; tail -5 "/tmp/ncu_ab/$name-run.log"; continue; }
    python3 - "/tmp/ncu_ab/$name-raw.csv" "$n $tag" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
m = dict(zip(rows[0], rows[2]))
g = lambda k: m.get(k, "?")
units = dict(zip(rows[0], rows[1]))
unit = lambda k: units.get(k, "")
print(f"{sys.argv[2]}: {g('gpu__time_duration.sum')} {unit('gpu__time_duration.sum')}, "
      f"inst {g('smsp__inst_executed.sum')}, ipc {g('sm__inst_executed.avg.per_cycle_active')}, "
      f"grid {g('launch__grid_size')}, L2 hit {g('lts__t_sector_hit_rate.pct')}%, "
      f"DRAM read {g('dram__bytes_read.sum')} {unit('dram__bytes_read.sum')}, "
      f"written {g('dram__bytes_write.sum')} {unit('dram__bytes_write.sum')}")
prefix = "smsp__pcsamp_warps_issue_stalled_"
stalls = {k[len(prefix):]: float(v.replace(",", "")) for k, v in m.items()
          if k.startswith(prefix) and not k.endswith("not_issued") and v.replace(",", "").replace(".", "").isdigit()}
total = sum(stalls.values()) or 1.0
top = sorted(stalls.items(), key=lambda kv: -kv[1])[:8]
print("  stalls: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in top))
# Where the cycles go: busy share of the tensor, MUFU (exp), FMA and ALU pipes and of DRAM, per active cycle.
pipes = ("pipe_tensor_cycles_active", "inst_executed_pipe_xu", "pipe_fma_cycles_active", "pipe_alu_cycles_active")
busy = {k: g(k) for k in m if k in {f"sm__{p}.avg.pct_of_peak_sustained_active" for p in pipes}}
busy["dram"] = m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed",
                     g("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"))
print("  busy %: " + ", ".join(f"{k.replace('sm__', '').replace('.avg.pct_of_peak_sustained_active', '')} {v}"
                               for k, v in sorted(busy.items())))
PY
    cp "/tmp/ncu_ab/$name-sass.csv" "$OUT/csv/$name.csv"
    cp "/tmp/ncu_ab/$name-details.txt" "$OUT/csv/$name-details.txt"
  done
done < <(if [ -n "$shapes" ]; then cat "$shapes"; else echo "$default_shapes"; fi)
(cd "$OUT" && tar czf sass.tgz csv && rm -rf csv)
