"""The last run's kernels of a profiled call (tools/profile_decode.py, profile_packed.py, profile_llama.py) under `ncu --metrics gpu__time_duration.sum --csv`
(tools/kernel_list.sh): the call runs several times after its compile with the same kernel sequence each
time, so the last run is the shortest tail of the list that repeats just before itself (twice, where the list is
long enough). Prints each kernel's time and their sum.
    python3 tools/kernel_list.py kernels-jax_flash.csv [--name LABEL]"""

import argparse
import csv

_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def kernels(path):
    """[(kernel name, microseconds)] in launch order from ncu's csv (other lines, the program's own output and
    ncu's ==PROF== notes, skipped)."""
    lines = [line for line in open(path, errors="replace") if line.startswith('"')]
    rows = list(csv.DictReader(lines))
    return [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * _TO_US[r["Metric Unit"]])
            for r in rows if r.get("Metric Name") == "gpu__time_duration.sum"]


def last_run(ks):
    """The shortest tail of ks (by names) that repeats right before itself (and before that too where possible)."""
    names = [n for n, _ in ks]
    for size in range(1, len(names) // 2 + 1):
        tail = names[-size:]
        if names[-2 * size:-size] == tail and (len(names) < 3 * size or names[-3 * size:-2 * size] == tail):
            return ks[-size:]
    return ks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--name", default="")
    a = ap.parse_args()
    ks = kernels(a.csv)
    if not ks:
        print(f"{a.name}: no kernels in {a.csv}")
        return
    run = last_run(ks)
    print(f"## {a.name}: {len(run)} kernels, {sum(us for _, us in run):.1f} µs (of {len(ks)} profiled)")
    for name, us in run:
        print(f"  {us:9.1f} µs  {name[:150]}")


if __name__ == "__main__":
    main()
