"""Summary of tools/decode_ab.sh's runs: per build, the geometric mean over rounds and shapes of jax_flash's time
relative to the first build (the order decode_ab.sh was given, kept in OUT_DIR/builds), by (Tq, layout), and the
paged / dense ratio; with --table also a markdown table of every shape's median time and share of the HBM peak per
build and the last build's speed over the first. --impl: the implementation whose rows are compared (default
jax_flash; e.g. jax_flash_1len when decode_ab.sh was given --impls jax_flash_1len).
    python3 tools/decode_ab.py OUT_DIR [--table] [--impl NAME]"""

import argparse
import collections
import glob
import json
import os
import statistics


def load(out, impl="jax_flash"):
    """(builds in decode_ab.sh's order, {(build, shape key): [(us, pct_peak) per round]}) of impl's rows."""
    runs = collections.defaultdict(list)
    for path in glob.glob(os.path.join(out, "*-r*", "ab-*.json")):
        build = os.path.basename(os.path.dirname(path)).rsplit("-r", 1)[0]
        for r in json.load(open(path))["rows"]:
            if r["impl"] == impl and r["us"]:
                key = (r["Hq"], r["Hkv"], r["D"], r["Tq"], r["B"], r["Sk"], r["ragged"], r["page_size"])
                runs[(build, key)].append((r["us"], r["pct_peak"]))
    found = sorted({b for b, _ in runs})
    order_file = os.path.join(out, "builds")
    order = open(order_file).read().split() if os.path.exists(order_file) else found
    return [b for b in order if b in found], runs


def main(out, table=False, impl="jax_flash"):
    builds, runs = load(out, impl)
    med = {k: statistics.median(x[0] for x in v) for k, v in runs.items()}
    base = builds[0]
    groups = collections.defaultdict(list)
    for (b, key), us in med.items():
        if (base, key) in med:
            groups[(b, key[3], "dense" if key[7] is None else f"paged{key[7]}", "ragged" if key[6] else "equal")].append(
                med[(base, key)] / us)
    print(f"speed relative to {base} (>1: faster), geometric mean over shapes of the median over rounds")
    for g in sorted(groups, key=lambda g: (builds.index(g[0]), g[1:])):
        print(g, f"{statistics.geometric_mean(groups[g]):.3f} (n={len(groups[g])})")
    for b in builds:
        ratios = collections.defaultdict(list)
        for (bb, key), us in med.items():
            if bb == b and key[7] is not None and (b, key[:7] + (None,)) in med:
                ratios[(key[3], key[7])].append(us / med[(b, key[:7] + (None,))])
        for k in sorted(ratios):
            print(b, "Tq", k[0], "page", k[1], f"paged/dense {statistics.geometric_mean(ratios[k]):.3f}")
    if table:
        last = builds[-1]
        print("\n| Tq | Hq/Hkv, D | B | S | lengths | layout | " + " | ".join(builds) + f" | {last} speed |")
        print("|---" * (7 + len(builds)) + "|")
        for key in sorted({k for _, k in runs}, key=lambda k: (k[3], k[0], k[1], k[2], k[4], k[5], k[6], k[7] or 0)):
            hq, hkv, d, tq, b, s, ragged, page = key
            cells = []
            for bb in builds:
                pct = [x[1] for x in runs.get((bb, key), [])]
                cells.append(f"{med[(bb, key)]:.1f} µs ({statistics.median(pct):.0f}%)" if pct else "–")
            speed = f"{med[(base, key)] / med[(last, key)]:.2f}" if (base, key) in med and (last, key) in med else "–"
            print(f"| {tq} | {hq}/{hkv}, {d} | {b} | {s} | {'ragged' if ragged else 'equal'} | "
                  f"{f'paged {page}' if page else 'dense'} | " + " | ".join(cells) + f" | {speed} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="summary of tools/decode_ab.sh's runs")
    ap.add_argument("out")
    ap.add_argument("--table", action="store_true", help="also a markdown table of every shape")
    ap.add_argument("--impl", default="jax_flash", help="the implementation compared (default jax_flash)")
    a = ap.parse_args()
    main(a.out, table=a.table, impl=a.impl)
