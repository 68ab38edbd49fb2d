#!/usr/bin/env python3
"""Plot docs/benchmarks/fleet.csv (from hack/bench-fleet.sh) into docs/benchmarks/fleet.png:
origin bytes (as multiples of the version) and the slowest node's seconds against N
(medians over rounds when the CSV has several).

usage: hack/plot-fleet.py [CSV] [PNG]     (needs matplotlib: pip install matplotlib)
"""
import collections
import csv
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    src = sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks/fleet.csv"
    dst = sys.argv[2] if len(sys.argv) > 2 else "docs/benchmarks/fleet.png"
    # Per (links, mode, N), per round: several rounds plot their median.
    runs = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in csv.DictReader(open(src)):
        key = (r.get("ack_first") or "0", r["mode"], int(r["nodes"]))
        runs[key][r.get("round") or "1"].append(r)
    both = len({ack for ack, _, _ in runs}) > 1
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {("peer", "1"): ("#1f77b4", "o-"), ("peer", "0"): ("#1f77b4", "s--"),
              ("origin-only", "1"): ("#d62728", "o-"), ("origin-only", "0"): ("#d62728", "s--")}
    for (mode, ack), (color, style) in styles.items():
        ns = sorted(n for a, m, n in runs if m == mode and a == ack)
        if not ns:
            continue
        origin, slowest = [], []
        for n in ns:
            rounds = runs[(ack, mode, n)].values()
            origin.append(statistics.median(
                sum(int(r["origin_bytes"]) for r in rs) / int(rs[0]["version_bytes"]) for rs in rounds))
            slowest.append(statistics.median(max(float(r["seconds"]) for r in rs) for rs in rounds))
        label = "with the peer tier" if mode == "peer" else "origin only"
        if both:
            label += ", ACKs first" if ack == "1" else ", FIFO links"
        ax1.plot(ns, origin, style, color=color, label=label)
        ax2.plot(ns, slowest, style, color=color, label=label)
        if mode == "peer" and (ack == "1" or not both) and ns[0] == 1:
            ax2.axhline(1.3 * slowest[0], color="grey", linestyle=":", label="1.3× one node alone")
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
