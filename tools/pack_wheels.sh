#!/usr/bin/env bash
# Several wheels in one carry: the device's carry is 64 MiB in all, and three sm_90a wheels (~22 MB each, deflated)
# pass it. Rewrites each dist/<name>/*.whl as an uncompressed (stored) zip and packs them into one xz tarball, which
# compresses the kernels' code far better than the wheels' own deflate (three wheels: 41 MB instead of 66).
#   bash tools/pack_wheels.sh OUT.tar.xz main nameA nameB      # here
#   tar xJf OUT.tar.xz                                          # on the device, in the repository root: dist/<name>/
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: pack_wheels.sh OUT.tar.xz NAME..." >&2; exit 2; }
out=$(realpath -m "$1"); shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp" "$@" <<'PY'
import glob, os, sys, zipfile
tmp, names = sys.argv[1], sys.argv[2:]
for name in names:
    (src,) = glob.glob(f"dist/{name}/*.whl")
    os.makedirs(f"{tmp}/dist/{name}")
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(f"{tmp}/dist/{name}/{os.path.basename(src)}", "w",
                                                    compression=zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            stored = zipfile.ZipInfo(info.filename, info.date_time)
            stored.external_attr = info.external_attr
            out.writestr(stored, z.read(info.filename))
PY
tar -C "$tmp" -cf - dist | xz -T0 -6 >"$out"
ls -l "$out"
