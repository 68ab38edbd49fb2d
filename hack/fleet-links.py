#!/usr/bin/env python3
"""What each node's link did during `hack/fleet.sh read` (FLEET_NIC_MBIT fleets): from the
0.5 s samples in $FLEET_DIR/links.txt ("seconds node down_bytes up_bytes"), each node's mean
download and upload rate, and the one number that tells a link's queue is in the way: the
download rate while that node's uplink is full (within 10% of FLEET_NIC_MBIT) against the rate
otherwise. With a plain FIFO per direction a node's download ACKs wait behind its upload, and
the first is well below the second.

usage: hack/fleet-links.py LINKS_TXT NIC_MBIT
"""
import collections
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    line_rate = float(sys.argv[2]) * 1e6 / 8
    samples = collections.defaultdict(list)
    for line in open(sys.argv[1]):
        fields = line.split()
        if len(fields) != 4:
            continue
        t, node, down, up = fields
        samples[int(node)].append((float(t), int(down), int(up)))
    full, other = [], []
    print("node  down MB/s  up MB/s  (means over the read)")
    for node in sorted(samples):
        s = samples[node]
        span = s[-1][0] - s[0][0]
        if span <= 0:
            continue
        print(f"{node:>4}  {(s[-1][1] - s[0][1]) / span / 1e6:9.1f}  {(s[-1][2] - s[0][2]) / span / 1e6:7.1f}")
        for (t0, d0, u0), (t1, d1, u1) in zip(s, s[1:]):
            dt = t1 - t0
            if dt <= 0:
                continue
            down, up = (d1 - d0) / dt, (u1 - u0) / dt
            if down < line_rate / 25 and up < line_rate / 25:
                continue  # idle: before the read, or done
            (full if up >= 0.9 * line_rate else other).append(down)
    mean = lambda xs: sum(xs) / len(xs) / 1e6 if xs else float("nan")
    print(f"download while the uplink is full: {mean(full):.1f} MB/s ({len(full)} samples); "
          f"otherwise {mean(other):.1f} MB/s ({len(other)} samples); line rate {line_rate / 1e6:.1f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
