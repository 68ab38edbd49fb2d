#!/usr/bin/env python3
"""Plot docs/benchmarks/fleet.csv (from hack/bench-fleet.sh) into docs/benchmarks/fleet.png:
origin bytes (as multiples of the version) and the slowest node's seconds against N.

usage: hack/plot-fleet.py [CSV] [PNG]     (needs matplotlib: pip install matplotlib)
"""
import collections
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    src = sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks/fleet.csv"
    dst = sys.argv[2] if len(sys.argv) > 2 else "docs/benchmarks/fleet.png"
    runs = collections.defaultdict(list)
    for r in csv.DictReader(open(src)):
        runs[(r["mode"], int(r["nodes"]))].append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, color in (("peer", "#1f77b4"), ("origin-only", "#d62728")):
        ns = sorted(n for m, n in runs if m == mode)
        if not ns:
            continue
        origin = [sum(int(r["origin_bytes"]) for r in runs[(mode, n)])
                  / int(runs[(mode, n)][0]["version_bytes"]) for n in ns]
        slowest = [max(float(r["seconds"]) for r in runs[(mode, n)]) for n in ns]
        label = "with the peer tier" if mode == "peer" else "origin only"
        ax1.plot(ns, origin, "o-", color=color, label=label)
        ax2.plot(ns, slowest, "o-", color=color, label=label)
    ax1.set(xlabel="nodes reading at once (N)", ylabel="origin bytes / version size",
            title="bytes read from the origin", xticks=[1, 2, 4, 8])
    ax1.axhline(1.3, color="grey", linestyle=":", label="1.3× bound")
    ax2.set(xlabel="nodes reading at once (N)", ylabel="seconds (slowest node)",
            title="time to read the version cold", xticks=[1, 2, 4, 8], ylim=(0, None))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
