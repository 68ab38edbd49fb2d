#!/usr/bin/env python3
"""Plot docs/benchmarks/push.csv (from hack/bench-push.sh) into docs/benchmarks/push.png.

usage: hack/plot-push.py [CSV] [PNG]     (needs matplotlib: pip install matplotlib)
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    src = sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks/push.csv"
    dst = sys.argv[2] if len(sys.argv) > 2 else "docs/benchmarks/push.png"
    rows = [r for r in csv.reader(open(src)) if len(r) == 5 and r[0] != "scenario"]
    changed = next(
        (int(r[1]) for r in csv.reader(open(src)) if r and r[0] == "changed_bytes"), 0
    )
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels, secs, colors = [], [], []
    palette = {"sealed push": "#1f77b4", "restic backup": "#d62728",
               "restic backup --force": "#d62728", "casync make": "#9467bd"}
    for scenario, tool, seconds, _gbps, _added in rows:
        if scenario == "changed10":
            continue
        labels.append(f"{scenario}\n{tool}")
        secs.append(float(seconds))
        colors.append(palette.get(tool, "#7f7f7f"))
    ax1.barh(labels[::-1], secs[::-1], color=colors[::-1])
    ax1.set_xlabel("seconds (median of 3, lower is better)")
    ax1.set_title("2 GiB file: hash, first push, re-push")
    tools = [r[1] for r in rows if r[0] == "changed10"]
    added = [int(r[4]) / changed if changed else 0 for r in rows if r[0] == "changed10"]
    ax2.bar(tools, added, color=[palette.get(t, "#7f7f7f") for t in tools])
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.axhline(1.25, color="grey", linestyle="--", linewidth=0.8)
    ax2.set_ylabel("bytes added / bytes changed")
    ax2.set_title("~10% overwritten in 8 MiB regions")
    for i, v in enumerate(added):
        ax2.text(i, v + 0.02, f"{v:.2f}x", ha="center")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
