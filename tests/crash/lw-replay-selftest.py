#!/usr/bin/env python3
"""Host self-test of tools/lw-replay.py.

1. A hand-made dm-log-writes log: entry parsing (marks, discards, data),
   replay to N and to a mark, the unflushed modes (a FUA write is always
   kept), the crash-point plan.
2. A log written by QEMU's blklogwrites driver (the same format, another
   writer) under its qcow2 driver: replayed to the end it gives the image
   QEMU wrote, and at every planned point "qemu-img check" finds no
   corruption (QEMU's qcow2 ordering is known good).
Exit 0 when all pass."""
import os
import struct
import subprocess
import sys
import tempfile

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                    "../../tools/lw-replay.py")
FLUSH, FUA, DISCARD, MARK = 1, 2, 4, 8


def make_log(path, entries):
    out = bytearray(512)
    for sector, nr, flags, data in entries:
        mark = data if flags & MARK else b""
        hdr = struct.pack("<QQQQ", sector, nr, flags, len(mark)) + mark
        out += hdr.ljust(512, b"\0")
        if not flags & (MARK | DISCARD):
            out += data
    out[0:28] = struct.pack("<QQQI", 0x6A736677736872, 1, len(entries), 512)
    open(path, "wb").write(out)


def run(*args):
    return subprocess.run([sys.executable, TOOL] + list(args), check=True,
                          capture_output=True, text=True).stdout


def sectors(img):
    d = open(img, "rb").read()
    return [d[i] if i < len(d) else 0 for i in range(0, 8 * 512, 512)]


def main():
    d = tempfile.mkdtemp()
    log, img = os.path.join(d, "log"), os.path.join(d, "img")
    s = lambda b, n=1: bytes([b]) * 512 * n
    make_log(log, [
        (0, 2, 0, s(1, 2)),          # 0: write sectors 0-1
        (0, 0, FLUSH, b""),          # 1
        (0, 0, MARK, b"m1"),         # 2
        (2, 1, 0, s(2)),             # 3
        (3, 1, FUA, s(3)),           # 4
        (1, 1, DISCARD, b""),        # 5
        (4, 1, 0, s(4)),             # 6
        (0, 0, FLUSH, b""),          # 7
    ])
    fails = 0

    def expect(what, got, want):
        nonlocal fails
        if got != want:
            print("FAIL %s: got %s, want %s" % (what, got, want))
            fails += 1

    lst = run("list", log).splitlines()
    expect("list length", len(lst), 9)
    expect("mark line", lst[3], "2 MARK 0 0 m1")
    expect("fua line", lst[5], "4 FUA 3 1")
    cases = [
        (["--to", "1"], [1, 1, 0, 0, 0]),
        (["--mark", "m1"], [1, 1, 0, 0, 0]),
        (["--to", "7"], [1, 0, 2, 3, 4]),
        (["--to", "7", "--unflushed", "none"], [1, 1, 0, 3, 0]),
        (["--to", "8", "--unflushed", "none"], [1, 0, 2, 3, 4]),
        (["--to", "5"], [1, 1, 2, 3, 0]),
    ]
    for args, want in cases:
        open(img, "wb").close()
        run("replay", log, img, *args)
        expect("replay " + " ".join(args), sectors(img)[:5], want)
    # Incremental: 0..3 then 3..8 gives the same as 0..8
    open(img, "wb").close()
    run("replay", log, img, "--to", "3")
    run("replay", log, img, "--from", "3", "--to", "8")
    expect("incremental", sectors(img)[:5], [1, 0, 2, 3, 4])
    # A random subset keeps the flushed part and the FUA write
    for seed in range(8):
        open(img, "wb").close()
        run("replay", log, img, "--to", "7", "--unflushed", "random",
            "--seed", str(seed))
        got = sectors(img)[:5]
        expect("random %d flushed+fua" % seed, (got[0], got[3]), (1, 3))
    plan = run("plan", log).splitlines()
    expect("plan has points", len(plan) >= 4, True)
    for line in plan:
        n, fl, mode, _, mark = line.split()
        if int(n) > 2:
            expect("plan mark at %s" % n, mark, "m1")
        expect("plan flushed <= n", int(fl) <= int(n), True)
    # 2. QEMU as the writer
    a, base, pt = (os.path.join(d, x) for x in ("a.qcow2", "base.qcow2",
                                                "pt.qcow2"))
    qlog = os.path.join(d, "qlog")
    sh = lambda *c: subprocess.run(c, check=True, capture_output=True)
    sh("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4k",
       a, "64M")
    sh("cp", a, base)
    open(qlog, "wb").truncate(64 << 20)
    cmds = []
    for k in range(12):
        cmds += ["-c", "write -P %d %d %d" % (k + 1, k * 4567 * 512,
                                             (k % 5 + 1) * 3072), "-c", "flush"]
    sh("qemu-io", "--image-opts", "driver=qcow2,file.driver=blklogwrites,"
       "file.file.filename=%s,file.log.filename=%s" % (a, qlog), *cmds)
    n = len(run("list", qlog).splitlines()) - 1
    sh("cp", base, pt)
    run("replay", qlog, pt, "--to", str(n))
    r = subprocess.run(["qemu-img", "compare", "-q", a, pt])
    expect("qemu log replayed to the end", r.returncode, 0)
    points = run("plan", qlog).splitlines()
    for line in points:
        n, _, mode, seed, _ = line.split()
        sh("cp", base, pt)
        run("replay", qlog, pt, "--to", n, "--unflushed", mode, "--seed", seed)
        r = subprocess.run(["qemu-img", "check", "-q", pt], capture_output=True)
        expect("qemu-img check at %s %s" % (n, mode), r.returncode in (0, 3),
               True)
    expect("qemu log points", len(points) > 30, True)
    # Stepping through the plan with "point" gives the same images
    cur, pt2 = os.path.join(d, "cur.qcow2"), os.path.join(d, "pt2.qcow2")
    sh("cp", base, cur)
    at = 0
    for line in points:
        n, fl, mode, seed, _ = line.split()
        run("point", qlog, cur, pt2, "--from", str(at), "--to", n,
            "--unflushed", mode, "--seed", seed)
        at = int(fl)
        sh("cp", base, pt)
        run("replay", qlog, pt, "--to", n, "--unflushed", mode, "--seed", seed)
        expect("point %s %s = replay" % (n, mode),
               open(pt, "rb").read() == open(pt2, "rb").read(), True)
    print("%d passed, %d failed" % (1, 0) if not fails else
          "0 passed, 1 failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
