#!/usr/bin/env bash
# On a GPU machine: checks the pending kernel patches (tools/pending/series) up to TOP (default: the last), whose
# wheel tools/build_pending.sh built into dist/TOP/ beside dist/main/. Applies the series up to TOP to a scratch copy
# of the working tree (/tmp/jf_pending, made afresh each call: a warm machine may keep files of an earlier call) and
# runs from there (its tests and scripts), then
#   tests  decode tests, compute-sanitizer memcheck and racecheck with TOP's wheel (tools/decode_gpu_check.sh tests);
#   ab     decode A/B of main against TOP (tools/decode_ab.sh: core preset, Tq 1 and 16, dense and paged 16, equal
#          lengths; ROUNDS rounds, default 2), the per-shape table in $OUT/ab.md;
#   abr    the same over dense caches with equal and ragged lengths (balanced splits), table in $OUT/abr.md;
#   suite  the attention GPU suite with TOP's wheel (its Python changes reach the forward too);
#   sanitize  compute-sanitizer memcheck (every kernel) and racecheck (the sm_90a kernels) over sanitize_small.py's
#          attention calls on the default kernels, with TOP's wheel (racecheck of the head-dim-256 calls 2, 4 and 9
#          on the backward kernels only: the sanitizer died there under the old split-D backward, NOTES session 26);
#   bwdab  backward A/B of main against TOP (tools/ab_bench.sh over BWD_SHAPES, ROUNDS rounds), then the packed
#          step (tools/packed_ab.sh, jax_flash rows); tables in $OUT/bwdab/ab_summary.txt and $OUT/packed/;
#   capab  A/B of main against TOP on bench_packed.py's modifiers table (plain, sinks, soft cap; jax_flash rows),
#          $OUT/capab/packed_ab.txt;
#   mufu   tools/mufu_bench.cu (the transcendental variants' throughput and error), $OUT/mufu.txt;
#   sweep  tools/decode_plan_sweep.py with TOP's wheel and SWEEP_ARGS (its arguments), $OUT/sweep.log and its
#          tables printed.
# One device call per mode (tests: up to ~7 minutes under decode_gpu_check.sh's timeouts; ab / abr: ~5-8 minutes at
# 2 rounds; suite + sanitize ~8; bwdab ~7); summary lines in $OUT/pending.txt.
#   OUT=... bash tools/pending_gpu_check.sh "tests ab" [TOP]
set -uo pipefail
cd "$(dirname "$0")/.."
read -r -a MODES <<<"${1:-tests}"
mapfile -t series < <(bash tools/pending_series.sh)
[ ${#series[@]} -gt 0 ] || { echo "pending_gpu_check: tools/pending/series lists no patch" >&2; exit 2; }
top=${2:-${series[-1]}}
top=${top%.patch}
OUT=${OUT:-$PWD/pending_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
note() { echo "$*" | tee -a "$OUT/pending.txt"; }
patches=$(bash tools/pending_series.sh "$top") || { note "$top is not in tools/pending/series"; exit 2; }
command -v git >/dev/null || { note "git is needed to apply the patches"; exit 1; }
rm -rf /tmp/jf_pending && cp -a . /tmp/jf_pending && cd /tmp/jf_pending || exit 1
for p in $patches; do
  git apply "tools/pending/$p" || { note "git apply $p failed"; exit 1; }
done
wheel=$(ls dist/"$top"/*.whl) || { note "no wheel in dist/$top (tools/build_pending.sh $top)"; exit 1; }
note "pending $top $(date -u +%Y-%m-%dT%H:%MZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
status=0
for mode in "${MODES[@]}"; do
  start=$SECONDS
  case $mode in
    tests)
      WHEEL=$wheel OUT=$OUT/tests bash tools/decode_gpu_check.sh tests >"$OUT/tests.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || status=1
      note "tests: rc=$rc ($((SECONDS - start)) s); $(tr '\n' ' ' <"$OUT/tests/summary.txt" 2>/dev/null)" ;;
    ab | abr)
      if [ "$mode" = ab ]; then rows=(--layouts dense,paged16 --lengths equal); else rows=(--layouts dense --lengths equal,ragged); fi
      OUT=$OUT/$mode bash tools/decode_ab.sh "main $top" "${ROUNDS:-2}" --preset core --tq 1,16 "${rows[@]}" \
        --calls 10 --reps 3 >"$OUT/$mode.log" 2>&1 || status=1
      python3 tools/decode_ab.py "$OUT/$mode" --table >"$OUT/$mode.md" 2>&1 || status=1
      note "$mode: ($((SECONDS - start)) s) $(grep -v '^|' "$OUT/$mode.md" | tr '\n' ' ')" ;;
    suite)
      rm -rf /tmp/jf_site && python3 -m pip install -q --no-index --no-deps --target /tmp/jf_site "$wheel" || exit 1
      repo=$PWD
      (cd /tmp && PYTHONPATH=/tmp/jf_site XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 560 python3 -m pytest -q \
        -p no:cacheprovider -n 4 -m "not slow" "$repo/tests/test_gpu.py" "$repo/tests/test_segments_sinks_softcap.py" \
        "$repo/tests/test_kernel_choice.py" >"$OUT/suite.log" 2>&1)
      rc=$?; [ $rc -eq 0 ] || status=1
      note "suite: rc=$rc $(tail -n 1 "$OUT/suite.log") ($((SECONDS - start)) s)" ;;
    sanitize)
      rm -rf /tmp/jf_site && python3 -m pip install -q --no-index --no-deps --target /tmp/jf_site "$wheel" || exit 1
      repo=$PWD
      # racecheck: the sm_90a kernels, but only the backward ones (kns=flash_bwd) on the head-dim-256 calls 2, 4, 9,
      # where the sanitizer died under the old split-D backward and the d256 forward is not raced (session 35)
      for run in "memcheck 0:10 -" "racecheck 0:2 kns=sm90_kernel" "racecheck 3:4 kns=sm90_kernel" \
          "racecheck 5:9 kns=sm90_kernel" "racecheck 2:3 kns=flash_bwd" "racecheck 4:5 kns=flash_bwd" \
          "racecheck 9:10 kns=flash_bwd"; do
        read -r tool cases kernels <<<"$run"
        t0=$SECONDS
        filter=(); [ $tool = racecheck ] && filter=(--kernel-name "$kernels")
        log="$OUT/sanitizer-$tool-${cases/:/_}.log"
        (cd /tmp && PYTHONPATH=/tmp/jf_site XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 compute-sanitizer \
          --tool $tool "${filter[@]}" --error-exitcode 9 python3 "$repo/tools/sanitize_small.py" --cases $cases \
          --decode-cases 0:0 >"$log" 2>&1)
        rc=$?; [ $rc -eq 0 ] || { status=1; tail -20 "$log"; }
        note "sanitize $tool $cases: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1) ($((SECONDS - t0)) s)"
      done ;;
    bwdab)
      shapes=${BWD_SHAPES:-16x1024x16x128c,16x1024x16x128,4x4096x16x128c,1x16384x16x128,2x8192x32/8x128c,16x2048x16x64c,4x4096x32x64}
      OUT=$OUT/bwdab bash tools/ab_bench.sh "main $top" "$shapes" "${ROUNDS:-2}" >"$OUT/bwdab.log" 2>&1 || status=1
      note "bwdab: ($((SECONDS - start)) s) $(tail -n 1 "$OUT/bwdab/ab_summary.txt" 2>/dev/null)"
      OUT=$OUT/packed RUN_LIMIT=200 bash tools/packed_ab.sh "main $top" "${ROUNDS:-2}" --impls jax_flash \
        >"$OUT/packed.log" 2>&1 || status=1
      note "packed: ($((SECONDS - start)) s) $(grep -E '\| ms \||geometric' "$OUT/packed/packed_ab.txt" 2>/dev/null | tr '\n' ' ')" ;;
    capab)
      OUT=$OUT/capab RUN_LIMIT=200 TABLES=modifiers bash tools/packed_ab.sh "main $top" "${ROUNDS:-2}" --impls jax_flash \
        >"$OUT/capab.log" 2>&1 || status=1
      note "capab: ($((SECONDS - start)) s) $(grep -E 'modifiers' "$OUT/capab/packed_ab.txt" 2>/dev/null | tr '\n' ' ')" ;;
    mufu)
      nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda tools/mufu_bench.cu -o /tmp/mufu_bench &&
        /tmp/mufu_bench >"$OUT/mufu.txt" 2>&1
      rc=$?; [ $rc -eq 0 ] || status=1
      note "mufu: rc=$rc ($((SECONDS - start)) s)"; cat "$OUT/mufu.txt" ;;
    sweep)
      (
        WHEEL=$wheel OUT=$OUT/sweep CHECK_NAME=sweep CHECK_ARGS="${SWEEP_ARGS:-}"
        source tools/gpu_site.sh >/dev/null
        repo=$PWD
        cd /tmp || exit 1
        # shellcheck disable=SC2086  # SWEEP_ARGS: the sweep's arguments, split on blanks
        timeout 560 python3 "$repo/tools/decode_plan_sweep.py" ${SWEEP_ARGS:?SWEEP_ARGS unset}
      ) >"$OUT/sweep.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || status=1
      note "sweep: rc=$rc ($((SECONDS - start)) s)"
      grep "^|" "$OUT/sweep.log" ;;
    *) note "unknown mode $mode"; status=2 ;;
  esac
done
exit $status
