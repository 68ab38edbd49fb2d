#!/usr/bin/env python3
"""The summary table of a hack/bench-fleet.sh CSV, in Markdown.

One row per (links, mode, N): with several rounds, each number is the median over rounds, and
"slowest / N=1" is the median of each round's slowest node over that round's own N = 1 (same
links, same mode), so one slow or fast node alone does not set every ratio. CSVs written
before rounds existed (no round or ack_first column) read as one round of FIFO links.

usage: hack/fleet-table.py CSV
"""
import collections
import csv
import statistics
import sys


def main() -> int:
    rows = list(csv.DictReader(open(sys.argv[1])))
    runs = collections.OrderedDict()
    for r in rows:
        key = (r.get("ack_first") or "0", r["mode"], int(r["nodes"]))
        runs.setdefault(key, collections.OrderedDict()).setdefault(r.get("round") or "1", []).append(r)
    shaped = any(r.get("nic_mbit") for r in rows)
    rounds = max(len(by_round) for by_round in runs.values())
    head = ["links"] if shaped else []
    head += ["mode", "N", "origin bytes / version", "slowest node s", "mean node s",
             "slowest / N=1", "mean / N=1", "max served / mean served", "CPU s / node",
             "machine busy"]
    if rounds > 1:
        head.append("rounds (slowest / N=1 each)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (ack, mode, n), by_round in runs.items():
        alone = runs.get((ack, mode, 1), {})
        origin, slowest, mean, ratio, mean_ratio, load, cpu, busy = ([] for _ in range(8))
        for rnd, rs in by_round.items():
            v = int(rs[0]["version_bytes"])
            secs = [float(r["seconds"]) for r in rs]
            served = [int(r["served_bytes"]) for r in rs]
            origin.append(sum(int(r["origin_bytes"]) for r in rs) / v)
            slowest.append(max(secs))
            mean.append(sum(secs) / len(secs))
            load.append(max(served) / (sum(served) / len(served)) if sum(served) else 0)
            cpu.append(statistics.mean(float(r.get("cpu_seconds") or 0) for r in rs))
            busy.append(float(rs[0].get("machine_busy") or 0))
            if rnd in alone:
                one = max(float(r["seconds"]) for r in alone[rnd])
                ratio.append(max(secs) / one)
                mean_ratio.append(sum(secs) / len(secs) / one)
        med = statistics.median
        cells = (["ACK-first" if ack == "1" else "FIFO"] if shaped else []) + [
            mode, str(n), f"{med(origin):.2f}×", f"{med(slowest):.1f}", f"{med(mean):.1f}",
            f"{med(ratio):.2f}×" if ratio else "-", f"{med(mean_ratio):.2f}×" if mean_ratio else "-",
            f"{med(load):.2f}", f"{med(cpu):.1f}", f"{med(busy):.0%}"]
        if rounds > 1:
            cells.append(", ".join(f"{x:.2f}×" for x in ratio) or "-")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
