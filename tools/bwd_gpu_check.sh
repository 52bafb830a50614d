#!/usr/bin/env bash
# Issue 20 on one GPU in one call: install the carried wheel (dist/*/) and the peers (.whl/), then any of
#   tests   the GPU tests of the backward (test_gpu.py, deterministic included) and compute-sanitizer on small shapes
#   bench   bench_attention.py over SHAPES (default: the targets' 18 shapes) with jax_flash, cudnn, xla, fa3_jax, tokamax
#   llama   examples/llama_block.py --mode bench with every attention that runs (2 x 4096, 1 x 8192)
#   ncu     Nsight Compute (clocks as found) of one forward+backward step of jax_flash and of FA3-jax at
#           NCU_SHAPE (default 4x4096x16x128 causal): every kernel's duration, and per backward main kernel the
#           details page (stall reasons, pipe utilisation), and the details pages of the kernels around it
# Summary in $OUT/summary.txt; results (JSON, md, png, ncu extracts) in $OUT, as $OUT/bwd_results.tgz when there are
# more than seven files.
#   bash tools/bwd_gpu_check.sh "bench ncu" [SHAPES]
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODES=${1:-"tests bench"}
SHAPES=${2:-"16x2048x16x64,16x2048x16x64c,4x4096x32x64,4x4096x32x64c,1x16384x32x64,1x16384x32x64c,16x1024x16x128,16x1024x16x128c,4x4096x16x128,4x4096x16x128c,1x16384x16x128,1x16384x16x128c,2x8192x32/8x128,2x8192x32/8x128c,4x4096x8x256,4x4096x8x256c,1x16384x8x256,1x16384x8x256c"}
OUT=${OUT:-$PWD/bwd_out}
CHECK_NAME=bwd_gpu_check CHECK_ARGS="modes=[$MODES]"
source tools/gpu_site.sh  # $OUT, note(), status; the wheel from dist/, the working tree's Python, the peers
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
day=$(date -u +%F)
for mode in $MODES; do
  t0=$SECONDS
  case $mode in
  tests)
    (cd /tmp && timeout 400 python3 -m pytest -q -x -p no:cacheprovider -n 4 "$REPO/tests/test_gpu.py" \
      "$REPO/tests/test_segments_sinks_softcap.py" >"$OUT/pytest.log" 2>&1)
    rc=$?; note "pytest: rc=$rc $(tail -1 "$OUT/pytest.log") ($((SECONDS - t0)) s)"; [ $rc -eq 0 ] || { status=1; tail -40 "$OUT/pytest.log"; }
    for tool in memcheck racecheck; do
      t0=$SECONDS
      filter=(); [ $tool = racecheck ] && filter=(--kernel-name kns=flash_)
      (cd /tmp && timeout 240 compute-sanitizer --tool $tool "${filter[@]}" --error-exitcode 9 python3 \
        "$REPO/tools/sanitize_small.py" >"$OUT/sanitizer-$tool.log" 2>&1)
      rc=$?; note "compute-sanitizer $tool: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1) ($((SECONDS - t0)) s)"
      [ $rc -eq 0 ] || { status=1; tail -30 "$OUT/sanitizer-$tool.log"; }
    done ;;
  bench)
    (cd /tmp && timeout 560 python3 "$REPO/benchmarks/bench_attention.py" --shapes "$SHAPES" --out "$OUT" \
      --name "$device-$day-peers") >"$OUT/bench_attention.log" 2>&1
    rc=$?; note "bench_attention: rc=$rc ($((SECONDS - t0)) s)"; [ $rc -eq 0 ] || status=1
    grep -E "^\| |Geometric|best peer|Not run" "$OUT/$device-$day-peers.md" 2>/dev/null | tail -30 ;;
  llama)
    (cd /tmp && timeout 560 python3 "$REPO/examples/llama_block.py" --mode bench --out "$OUT" \
      --name "llama_block-$device-$day-peers") >"$OUT/llama_block.log" 2>&1
    rc=$?; note "llama_block bench: rc=$rc ($((SECONDS - t0)) s)"; [ $rc -eq 0 ] || status=1
    grep -E "^\| [0-9]|best peer|Not run" "$OUT/llama_block-$device-$day-peers.md" 2>/dev/null | tail -20 ;;
  ncu)
    IFS=x read -r b s h d <<<"${NCU_SHAPE:-4x4096x16x128c}"
    causal=(); [[ $d == *c ]] && causal=(--causal); d=${d%c}
    for impl in ${NCU_IMPLS:-jax_flash fa3_jax}; do
      rep=/tmp/ncu-$impl  # the report stays on the device; text extracts come back
      (cd /tmp && timeout 240 ncu -f --clock-control none --set full --import-source yes --kernel-name-base demangled \
        -k regex:flash -c 10 -o $rep python3 "$REPO/tools/profile_one.py" --impl $impl --batch $b --seqlen $s \
        --heads $h --head-dim $d "${causal[@]}") >/tmp/ncu-$impl-run.log 2>&1 || { status=1; tail -5 /tmp/ncu-$impl-run.log; }
      ncu -i $rep.ncu-rep --page raw --csv --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active >/tmp/ncu-$impl-raw.csv 2>&1
      note "ncu $impl ${NCU_SHAPE:-4x4096x16x128c} (ms per kernel):"
      python3 - /tmp/ncu-$impl-raw.csv <<'PY' | tee -a "$SUMMARY"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if head is None:
    print("  no kernels"); sys.exit()
cols = rows[head]
for r in rows[head + 2:]:
    d = dict(zip(cols, r))
    print(f"  {d.get('gpu__time_duration.sum', '?'):>10}  grid {d.get('launch__grid_size', '?'):>7}  regs "
          f"{d.get('launch__registers_per_thread', '?'):>4}  tensor {d.get('sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active', '?'):>6}%  {d.get('Kernel Name', '')[:90]}")
PY
      # the backward main kernel: its details page, its stall-reason samples and its per-instruction SASS view
      kn='regex:flash_bwd_sm90_kernel|flash_bwd_sm90_d256_kernel|FlashAttnBwdSm90'
      ncu -i $rep.ncu-rep --kernel-name-base demangled -k "$kn" --page details >"$OUT/ncu-$impl-bwd-details.txt" 2>&1
      ncu -i $rep.ncu-rep --kernel-name-base demangled -k "$kn" --page raw --csv 2>/dev/null | python3 -c "
import csv, sys
rows = list(csv.reader(sys.stdin))
head = next(i for i, r in enumerate(rows) if 'Kernel Name' in r)
for name, unit, value in zip(rows[head], rows[head + 1], rows[head + 2]):
    if 'stall' in name or 'pipe' in name or 'inst_executed' in name or 'barrier' in name:
        print(f'{name},{unit},{value}')" >"$OUT/ncu-$impl-bwd-metrics.csv" 2>&1
      ncu -i $rep.ncu-rep --kernel-name-base demangled -k "$kn" --page source --csv --print-source sass \
        2>/dev/null | gzip >"$OUT/ncu-$impl-bwd-sass.csv.gz"
      # the kernels around it (row statistics / dQ zeroing before, dQ conversion after): their details pages
      ncu -i $rep.ncu-rep --kernel-name-base demangled -k 'regex:[Pp]reprocess|[Cc]onvert|[Pp]ostprocess' \
        --page details >"$OUT/ncu-$impl-prepost-details.txt" 2>&1
    done ;;
  *) note "unknown mode $mode"; status=1 ;;
  esac
done
note "bwd_gpu_check done: status=$status"
# the device returns a handful of files: more than that travel as one archive
if [ "$(find "$OUT" -type f | wc -l)" -gt 7 ]; then
  (cd "$OUT" && tar czf /tmp/bwd_results.tgz --exclude summary.txt . && find . -type f ! -name summary.txt -delete &&
    mv /tmp/bwd_results.tgz .)
fi
cat "$SUMMARY"
exit $status
