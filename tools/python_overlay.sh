#!/usr/bin/env bash
# Copies the working tree's jax_flash/*.py over an installed build's package (Python edits made after its wheel was
# built), except the files that build's own patches change: for NAME in tools/pending/series, the patches up to and
# including it (tools/build_pending.sh applied them to the wheel; main's copy of such a file would not match the
# wheel's kernels or workspaces: session 44's v2 check ran main's _ffi.py over a wheel with another workspace shape).
#   bash tools/python_overlay.sh NAME PACKAGE_DIR     (PACKAGE_DIR: the installed jax_flash/ directory)
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1
dest=$2
keep=()  # (a name not in the series, main or a dropped patch's, keeps nothing: every file is copied)
if [ "$name" != main ] && patches=$(bash tools/pending_series.sh "$name" 2>/dev/null); then
  for patch in $patches; do
    while read -r _ _ path; do
      case $path in jax_flash/*.py) keep+=("$(basename "$path")") ;; esac
    done < <(git apply --numstat "tools/pending/$patch")
  done
fi
for f in jax_flash/*.py; do
  base=$(basename "$f")
  if [[ " ${keep[*]:-} " == *" $base "* ]]; then
    echo "python_overlay: $name keeps its wheel's $base (its patches change it)"
  else
    cp "$f" "$dest/$base"
  fi
done
