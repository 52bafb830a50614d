#!/usr/bin/env bash
# Several wheels in one carry: the device's carry is 64 MiB in all, and three sm_90a wheels (~22 MB each, deflated)
# pass it. Rewrites each dist/<name>/ wheel as an uncompressed (stored) zip and packs them, with each build's
# dist/<name>/env if it has one (ab_bench.sh's run-time variants), into one xz tarball, which compresses the kernels'
# code far better than the wheels' own deflate; its 192 MiB window (a wheel is ~62 MB stored) stores the kernels that
# the wheels share once (three wheels: 66 MB deflated, 41 MB with xz's default 8 MiB window; four: 33-40 MB).
#   bash tools/pack_wheels.sh OUT.tar.xz main nameA nameB      # here
#   tar xJf OUT.tar.xz                                          # on the device, in the repository root: dist/<name>/
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: pack_wheels.sh OUT.tar.xz NAME..." >&2; exit 2; }
out=$(realpath -m "$1"); shift  # (before the cd: relative to the caller's directory)
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp" "$@" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, names = sys.argv[1], sys.argv[2:]
for name in names:
    wheels = glob.glob(f"dist/{name}/*.whl")
    if len(wheels) != 1:
        sys.exit(f"pack_wheels: dist/{name}/ holds {len(wheels)} wheels, expected one")
    src = wheels[0]
    os.makedirs(f"{tmp}/dist/{name}")
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(f"{tmp}/dist/{name}/{os.path.basename(src)}", "w",
                                                    compression=zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            stored = zipfile.ZipInfo(info.filename, info.date_time)
            stored.external_attr = info.external_attr
            out.writestr(stored, z.read(info.filename))
    if os.path.exists(f"dist/{name}/env"):
        shutil.copy(f"dist/{name}/env", f"{tmp}/dist/{name}/env")
PY
tar -C "$tmp" -cf - dist | xz -T1 --lzma2=preset=6,dict=192MiB >"$out"
ls -l "$out"
