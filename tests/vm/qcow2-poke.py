#!/usr/bin/python3
# SPDX-License-Identifier: GPL-2.0-only
"""Read and patch the metadata of a qcow2 image, for the corruption tests.

  qcow2-poke.py layout IMG          key=value lines: cluster_size,
                                    l1_off, l1_size, rt_off, rt_clusters,
                                    l1_0.. (L2 table offsets of the first
                                    L1 entries), rb_0 (first refcount
                                    block), version, size, file_size
  qcow2-poke.py get IMG OFF         the big-endian u64 at OFF, in hex
  qcow2-poke.py put IMG OFF VALUE   write VALUE (any int literal) there
  qcow2-poke.py mutate SEED OUT N K write K mutated copies of SEED as
                                    OUT-<i>.qcow2 (i = 0..K-1), run N
                                    (the random seed); prints one line per
                                    image: "<file> <sectors> <what>"

The mutator is deterministic for a given (SEED bytes, N): it picks byte
flips, byte overwrites and u64 overwrites with chosen values, mostly in
the header, the L1 table, the L2 tables, the refcount table and blocks.
"""
import os
import random
import struct
import sys

MASK = 0x00fffffffffffe00


def be64(b, off):
    return struct.unpack_from(">Q", b, off)[0]


def layout(b):
    h = {}
    h["version"] = struct.unpack_from(">I", b, 4)[0]
    bits = struct.unpack_from(">I", b, 20)[0]
    h["cluster_size"] = 1 << bits
    h["size"] = be64(b, 24)
    h["l1_size"] = struct.unpack_from(">I", b, 36)[0]
    h["l1_off"] = be64(b, 40)
    h["rt_off"] = be64(b, 48)
    h["rt_clusters"] = struct.unpack_from(">I", b, 56)[0]
    h["file_size"] = len(b)
    for i in range(min(h["l1_size"], 4)):
        h["l1_%d" % i] = be64(b, h["l1_off"] + 8 * i) & MASK
    h["rb_0"] = be64(b, h["rt_off"]) & ~0x1ff
    return h


def regions(b, h):
    """(start, length) of the places worth mutating, in the file."""
    cs = h["cluster_size"]
    out = [(0, min(cs, 512, len(b)))]
    out.append((h["l1_off"], max(8, min(h["l1_size"] * 8, cs))))
    out.append((h["rt_off"], min(h["rt_clusters"] * cs, cs)))
    for i in range(min(h["l1_size"], 4)):
        if h["l1_%d" % i]:
            out.append((h["l1_%d" % i], cs))
    if h["rb_0"]:
        out.append((h["rb_0"], cs))
    return [(s, n) for (s, n) in out if 0 <= s < len(b) and n > 0]


def interesting(h, rnd):
    cs = h["cluster_size"]
    fs = h["file_size"]
    flags = rnd.choice([0, 1 << 63, 1 << 62, 1, (1 << 63) | 1])
    return rnd.choice([
        0, 1, 0xffffffffffffffff, 1 << 63, 1 << 56, 1 << 62,
        cs, cs + 512, fs, fs + cs, (fs // cs) * cs - cs, 1 << 40,
        h["l1_off"] | flags, h["rt_off"] | flags, h["rb_0"] | flags,
        h.get("l1_0", 0) | flags, h.get("l1_1", 0) | flags,
        rnd.getrandbits(64), rnd.getrandbits(20) * 512 | flags,
    ])


def mutate(seed, out, n, k):
    data = open(seed, "rb").read()
    h = layout(data)
    base = os.path.basename(seed)
    for i in range(k):
        rnd = random.Random("%s/%d/%d" % (base, n, i))
        b = bytearray(data)
        regs = regions(b, h)
        what = []
        for _ in range(rnd.randint(1, 6)):
            start, length = rnd.choice(regs)
            op = rnd.randrange(3)
            if op == 0:
                off = start + rnd.randrange(length)
                bit = rnd.randrange(8)
                b[off] ^= 1 << bit
                what.append("flip@%d.%d" % (off, bit))
            elif op == 1:
                off = start + rnd.randrange(length)
                b[off] = rnd.randrange(256)
                what.append("byte@%d=%d" % (off, b[off]))
            else:
                off = start + rnd.randrange(max(1, length // 8)) * 8
                if off + 8 > len(b):
                    continue
                v = interesting(h, rnd)
                struct.pack_into(">Q", b, off, v)
                what.append("u64@%d=%#x" % (off, v))
        name = "%s-%d.qcow2" % (out, i)
        with open(name, "wb") as f:
            f.write(b)
        # The device length: the virtual size the header now claims,
        # capped so that reading it all stays cheap
        size = be64(b, 24)
        if size == 0 or size > h["size"]:
            size = h["size"]
        print("%s %d %s" % (name, max(size // 512, 1), ",".join(what) or "-"))


def main():
    cmd = sys.argv[1]
    if cmd == "layout":
        b = open(sys.argv[2], "rb").read()
        for key, val in layout(b).items():
            print("%s=%d" % (key, val))
    elif cmd == "get":
        with open(sys.argv[2], "rb") as f:
            f.seek(int(sys.argv[3], 0))
            print("%#x" % struct.unpack(">Q", f.read(8))[0])
    elif cmd == "put":
        with open(sys.argv[2], "r+b") as f:
            f.seek(int(sys.argv[3], 0))
            f.write(struct.pack(">Q", int(sys.argv[4], 0) & (2**64 - 1)))
    elif cmd == "mutate":
        mutate(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit("unknown command " + cmd)


if __name__ == "__main__":
    main()
