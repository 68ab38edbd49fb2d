#!/usr/bin/env python3
"""Summarise docs/benchmarks/load.csv (from hack/bench-load.sh): a Markdown table of the best
of the runs per case and the issue's ratios on stdout, and a bar chart (PNG) of the cases.

usage: hack/plot-load.py CSV PNG BYTES LATENCY_MS     (needs matplotlib)
"""
import collections
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CASES = [
    ("a", "local disk"),
    ("b", "fresh mount, file:// store"),
    ("c", "second mount (hydrated, passthrough)"),
    ("a-reread", "local disk, page cache"),
    ("c-reread", "hydrated mount, page cache"),
    ("d", "fresh mount, S3 at {lat} ms"),
    ("d-model", "fresh mount, S3, --prefetch model"),
    ("get", "parallel GET of the chunks (bytes only)"),
    ("pull", "sealed pull (bytes only)"),
    ("e", "sealed pull, then load"),
    ("f-replay", "second node, learned profile"),
    ("f-plain", "second node, no profile"),
    ("odirect-a", "O_DIRECT, local disk"),
    ("odirect-c", "O_DIRECT, hydrated mount"),
]
# Rows that are not load times: shown in the table, not in the plot or the ratios.
OTHER = [
    ("c-cpu", "CPU seconds of c's serving process during its load"),
    ("c-verify", "wall seconds of c's checks of the hydrated files (beside the load)"),
]

# (name, numerator, denominator, goal, "<=" or ">="): ratios of best times.
GOALS = [
    ("(b) fresh mount / local", "b", "a", 1.1, "<="),
    ("(c) hydrated mount / local", "c", "a", 1.05, "<="),
    ("page-cache re-read: native / hydrated mount (speed ratio)", "a-reread", "c-reread", 0.95, ">="),
    ("(d) parallel GET / mount (speed ratio)", "get", "d", 0.9, ">="),
    ("(d) mount / (e) pull then load", "d", "e", 0.6, "<="),
    ("mount / pull (pull at least as fast: >= 1)", "d", "pull", 1.0, ">="),
    ("(f) no profile / with profile (speed-up)", "f-plain", "f-replay", 1.5, ">="),
    ("O_DIRECT: native / hydrated mount (speed ratio)", "odirect-a", "odirect-c", 0.9, ">="),
]


def main() -> int:
    src, dst, nbytes, lat = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    runs = collections.defaultdict(list)
    for r in csv.DictReader(open(src)):
        runs[r["case"]].append(float(r["seconds"]))
    best = {c: min(v) for c, v in runs.items()}
    n = max(len(v) for v in runs.values())
    print(f"{nbytes / 2**30:.2f} GiB checkpoint in 4 safetensors shards; best of {n}; "
          f"S3 = s3s-fs behind toxiproxy, {lat} ms each way")
    print()
    print("| case | best s | GB/s | runs, s |")
    print("|---|---:|---:|---|")
    for case, label in CASES:
        if case in best:
            runs_s = ", ".join(f"{s:.2f}" for s in runs[case])
            print(f"| {case}: {label.format(lat=lat)} | {best[case]:.2f} | "
                  f"{nbytes / best[case] / 1e9:.2f} | {runs_s} |")
    for case, label in OTHER:
        if case in best:
            runs_s = ", ".join(f"{s:.2f}" for s in runs[case])
            print(f"| {case}: {label} | {best[case]:.2f} | | {runs_s} |")
    print()
    print("| ratio | this run | goal | met |")
    print("|---|---:|---:|---|")
    for name, num, den, goal, op in GOALS:
        if num in best and den in best:
            r = best[num] / best[den]
            met = r <= goal if op == "<=" else r >= goal
            print(f"| {name} | {r:.2f} | {op} {goal} | {'yes' if met else 'no'} |")

    shown = [(c, label.format(lat=lat)) for c, label in CASES if c in best]
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(shown) + 1.2))
    colors = {"a": "#7f7f7f", "a-reread": "#7f7f7f", "odirect-a": "#7f7f7f",
              "get": "#9467bd", "pull": "#d62728", "e": "#d62728", "f-plain": "#ff7f0e"}
    ys = range(len(shown))[::-1]
    secs = [best[c] for c, _ in shown]
    ax.barh(list(ys), secs, color=[colors.get(c, "#1f77b4") for c, _ in shown])
    ax.set_yticks(list(ys), [f"{c}: {label}" for c, label in shown], fontsize=8)
    for y, s in zip(ys, secs):
        ax.text(s, y, f" {s:.2f} s ({nbytes / s / 1e9:.2f} GB/s)", va="center", fontsize=7)
    ax.set_xlabel(f"seconds to load {nbytes / 2**30:.1f} GiB (best of {n}; grey: native, "
                  "blue: sealed mount, red: pull)")
    ax.set_xlim(0, max(secs) * 1.35)
    ax.set_title("Loading a safetensors checkpoint (hack/bench-load.sh)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
