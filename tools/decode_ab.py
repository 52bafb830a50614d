"""Summary of tools/decode_ab.sh's runs: per build, the geometric mean over rounds and shapes of jax_flash's time
relative to the first build, by (Tq, layout), and the paged / dense ratio.
    python3 tools/decode_ab.py OUT_DIR"""

import collections
import glob
import json
import os
import statistics
import sys


def main(out):
    times = collections.defaultdict(list)  # (build, shape key) -> us over rounds
    for path in glob.glob(os.path.join(out, "*-r*", "ab-*.json")):
        build = os.path.basename(os.path.dirname(path)).rsplit("-r", 1)[0]
        for r in json.load(open(path))["rows"]:
            if r["impl"] == "jax_flash" and r["us"]:
                key = (r["Hq"], r["Hkv"], r["D"], r["Tq"], r["B"], r["Sk"], r["ragged"], r["page_size"])
                times[(build, key)].append(r["us"])
    builds = sorted({b for b, _ in times})
    med = {k: statistics.median(v) for k, v in times.items()}
    base = builds[0]
    groups = collections.defaultdict(list)
    for (b, key), us in med.items():
        if (base, key) in med:
            groups[(b, key[3], "dense" if key[7] is None else f"paged{key[7]}")].append(med[(base, key)] / us)
    print(f"speed relative to {base} (>1: faster), geometric mean over shapes of the median over rounds")
    for g in sorted(groups):
        print(g, f"{statistics.geometric_mean(groups[g]):.3f} (n={len(groups[g])})")
    for b in builds:
        ratios = collections.defaultdict(list)
        for (bb, key), us in med.items():
            if bb == b and key[7] is not None and (b, key[:7] + (None,)) in med:
                ratios[(key[3], key[7])].append(us / med[(b, key[:7] + (None,))])
        for k in sorted(ratios):
            print(b, "Tq", k[0], "page", k[1], f"paged/dense {statistics.geometric_mean(ratios[k]):.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
