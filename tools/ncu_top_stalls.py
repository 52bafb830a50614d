"""The instructions of an Nsight Compute source export (ncu --page source --csv --print-source sass, as
tools/ncu_kernel.sh writes it) with the most warp-stall samples, and the samples' total: where a kernel waits.

    python3 tools/ncu_top_stalls.py OUT/name-sass.csv [--top 25]
"""

import argparse
import csv


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.csv, newline="") as f:
        rows = [r for r in csv.reader(f)]
    head = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
    cols = rows[head]
    src = cols.index("Source")
    stall = next(i for i, c in enumerate(cols) if c.startswith("Warp Stall Sampling (All"))
    addr = cols.index("Address") if "Address" in cols else None

    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    # The export can hold the kernel more than once (a block per matched launch, each with its own header row; the
    # two of session 51's call 6 were identical): read the first block only, or every instruction is listed twice.
    heads = [i for i, r in enumerate(rows) if i > head and "Source" in r]
    body = [r for r in rows[head + 1:heads[0] if heads else len(rows)] if len(r) > max(src, stall)]
    total = sum(num(r[stall]) for r in body)
    blocks = f" (the first of {len(heads) + 1} blocks in the export)" if heads else ""
    print(f"{len(body)} instructions, {total:.0f} stall samples{blocks}")
    for r in sorted(body, key=lambda r: -num(r[stall]))[:a.top]:
        where = r[addr] if addr is not None else ""
        print(f"{num(r[stall]):8.0f} {100 * num(r[stall]) / max(total, 1):5.1f}%  {where:>6}  {r[src].strip()[:90]}")


if __name__ == "__main__":
    main()
