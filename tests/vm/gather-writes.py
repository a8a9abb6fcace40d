#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-only
"""Write page patterns through a block device's page cache and into a raw
copy alike, then fsync the device once, so that its write-back sends the
pages of each cluster together (t-write.sh gather_case).

Usage: gather-writes.py DEVICE RAW_COPY [SEED]
"""
import os
import random
import sys

M = 1 << 20
P = 4096


def main():
    dev, ref = sys.argv[1], sys.argv[2]
    rnd = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    fd = os.open(dev, os.O_WRONLY)
    fr = os.open(ref, os.O_WRONLY)

    def put(off, n):
        data = rnd.randbytes(n)
        for f in (fd, fr):
            if os.pwrite(f, data, off) != n:
                sys.exit(f"short write at {off}")

    # Whole clusters: 4 MiB at 1 MiB (not cluster-aligned at 2 MiB)
    for off in range(1 * M, 5 * M, 64 * 1024):
        put(off, 64 * 1024)
    # Every other page of 12M..14M: gathered writes with zeros between
    for off in range(12 * M, 14 * M, 2 * P):
        put(off, P)
    # 16M..17M backwards, every third page left out
    for off in reversed(range(16 * M, 17 * M, P)):
        if (off // P) % 3:
            put(off, P)
    # Pages of the zero cluster at 20M (zeros under a v2 image's write)
    for i in (1, 2, 3, 4, 5, 9, 15):
        put(20 * M + i * P, P)
    # In place in the cluster at 24M
    put(24 * M + 2 * P, P)
    os.fsync(fd)
    os.close(fd)
    os.close(fr)


if __name__ == "__main__":
    main()
