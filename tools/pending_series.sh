#!/usr/bin/env bash
# The patches of tools/pending/series, one a line: all of them, or with NAME (a patch's name, .patch optional) those
# up to and including it, in the order they apply on top of main; exit 2 (nothing printed) when NAME is not listed.
# Shared by build_pending.sh, pending_gpu_check.sh and python_overlay.sh.
#   bash tools/pending_series.sh [NAME]
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t series < <(grep -v '^\s*\(#\|$\)' tools/pending/series)
if [ $# -eq 0 ]; then
  [ ${#series[@]} -eq 0 ] || printf '%s\n' "${series[@]}"
  exit 0
fi
upto=()
for patch in "${series[@]}"; do
  upto+=("$patch")
  if [ "${patch%.patch}" = "${1%.patch}" ]; then
    printf '%s\n' "${upto[@]}"
    exit 0
  fi
done
echo "pending_series: ${1%.patch} is not in tools/pending/series" >&2
exit 2
