#!/usr/bin/env python3
"""Read random ranges of a block device with O_DIRECT and compare them with
a raw reference file.

usage: randread.py DEVICE REFERENCE COUNT [MAX_BYTES] [SEED]

Ranges are 512-byte aligned, 512 B to MAX_BYTES long (default 2 MiB), so
they start and end inside clusters, cross cluster boundaries and exceed
them. Exits 1 at the first mismatch, naming the offset.
"""
import mmap
import os
import random
import sys


def main():
    dev, ref, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    max_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else 2 << 20
    rnd = random.Random(int(sys.argv[5]) if len(sys.argv) > 5 else 1)
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    size = os.lseek(fd, 0, os.SEEK_END)
    buf = mmap.mmap(-1, max_bytes)
    with open(ref, 'rb') as rf:
        for _ in range(count):
            sectors = rnd.randint(1, max_bytes // 512)
            length = min(sectors * 512, size)
            off = rnd.randrange(0, (size - length) // 512 + 1) * 512
            view = memoryview(buf)[:length]
            got = os.preadv(fd, [view], off)
            rf.seek(off)
            want = rf.read(length)
            if got != length or view.tobytes() != want:
                print(f'mismatch at offset {off} length {length} (read {got})')
                return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
