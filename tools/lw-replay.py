#!/usr/bin/env python3
"""Read a dm-log-writes log and rebuild the logged device at a crash point.

The log (Documentation/admin-guide/device-mapper/log-writes.rst): a super
block in the first sector (magic, version, number of entries, sector
size), then for each entry one sector holding the entry header (sector,
nr_sectors, flags, data_len; a mark keeps its name after the header)
followed by nr_sectors sectors of data. Writes are logged in the order
they completed, and only once a flush covering them completed, so
the log reads as what reached stable storage, flush by flush.

A power cut at entry N (entries 0..N-1 have completed) leaves every write
before the last flush below N on disk; the writes after that flush may
have reached the disk in any subset. FUA writes are durable on their own
and are always kept. "--unflushed" chooses which of the others are
applied: all (the prefix), none, or a random subset (--seed).

Commands:
  list LOG                           index, flags, sector, sectors, mark
  replay LOG IMG (--to N | --mark NAME) [--from M] [--unflushed MODE]
         [--seed S]                  apply entries M..N-1 to IMG in place
                                     (--mark NAME: up to and including it)
  point LOG CUR PT --from M --to N [--unflushed MODE] [--seed S]
                                     for stepping through a plan: apply
                                     M..F-1 to CUR (F: past the last flush
                                     before N), copy CUR to PT, apply the
                                     rest of the crash point to PT
  plan LOG [--max K] [--seed S]      crash points, one a line:
                                     "N FLUSHED MODE SEED MARK": crash at N,
                                     FLUSHED = just past the last flush
                                     before N, MARK = the last mark before
                                     N (- if none)
"""
import argparse
import random
import struct
import sys

MAGIC = 0x6A736677736872
FLUSH, FUA, DISCARD, MARK, METADATA = 1, 2, 4, 8, 16
FLAG_NAMES = ((FLUSH, "FLUSH"), (FUA, "FUA"), (DISCARD, "DISCARD"),
              (MARK, "MARK"), (METADATA, "META"))


class Entry:
    __slots__ = ("index", "sector", "nr", "flags", "data_len", "data_pos",
                 "mark")

    def flag_str(self):
        return "|".join(n for b, n in FLAG_NAMES if self.flags & b) or "-"

    def is_write(self):
        return self.nr > 0 and not self.flags & MARK


def read_log(path):
    """(sector size, entries) of the log in the file or device PATH."""
    with open(path, "rb") as f:
        sup = f.read(32)
        magic, version, nr, ssize = struct.unpack("<QQQI", sup[:28])
        if magic != MAGIC:
            sys.exit("%s: not a dm-log-writes log (magic %#x)" % (path, magic))
        if version != 1:
            sys.exit("%s: log version %d, want 1" % (path, version))
        entries = []
        pos = ssize
        for i in range(nr):
            f.seek(pos)
            hdr = f.read(ssize)
            if len(hdr) < 32:
                sys.exit("%s: entry %d is past the end of the log" % (path, i))
            e = Entry()
            e.index = i
            e.sector, e.nr, e.flags, e.data_len = struct.unpack("<QQQQ",
                                                                hdr[:32])
            e.mark = None
            if e.flags & MARK:
                e.mark = hdr[32:32 + e.data_len].decode(errors="replace")
            e.data_pos = pos + ssize
            pos += ssize
            if not e.flags & DISCARD:
                pos += e.nr * ssize
            entries.append(e)
    return ssize, entries


def last_flush_before(entries, n):
    """Index just past the last flush among entries[0:n] (0 if none)."""
    for i in range(n - 1, -1, -1):
        if entries[i].flags & FLUSH:
            return i + 1
    return 0


def chosen(entries, start, n, mode, seed):
    """The entries of start..n-1 that a crash at n leaves on disk."""
    flushed = max(start, last_flush_before(entries, n))
    out = entries[start:flushed]
    rng = random.Random(seed)
    for e in entries[flushed:n]:
        if mode == "all" or e.flags & FUA:
            out.append(e)
        elif mode == "random" and rng.random() < 0.5:
            out.append(e)
    return out


def apply(log, ssize, entries, img):
    zero = None
    with open(log, "rb") as src, open(img, "r+b") as dst:
        for e in entries:
            if not e.nr or e.flags & MARK:
                continue
            dst.seek(e.sector * ssize)
            if e.flags & DISCARD:
                if zero is None:
                    zero = bytes(1 << 20)
                left = e.nr * ssize
                while left:
                    k = min(left, len(zero))
                    dst.write(zero[:k])
                    left -= k
                continue
            src.seek(e.data_pos)
            dst.write(src.read(e.nr * ssize))


def cmd_list(a):
    ssize, entries = read_log(a.log)
    print("# sector size %d, %d entries" % (ssize, len(entries)))
    for e in entries:
        print("%d %s %d %d%s" % (e.index, e.flag_str(), e.sector, e.nr,
                                 " " + e.mark if e.mark is not None else ""))


def cmd_replay(a):
    ssize, entries = read_log(a.log)
    if a.mark is not None:
        m = [e.index for e in entries if e.mark == a.mark]
        if not m:
            sys.exit("no mark %s" % a.mark)
        n = m[0] + 1
    else:
        n = a.to
    if not 0 <= a.start <= n <= len(entries):
        sys.exit("bad range %d..%d (%d entries)" % (a.start, n, len(entries)))
    apply(a.log, ssize, chosen(entries, a.start, n, a.unflushed, a.seed),
          a.img)


def cmd_point(a):
    ssize, entries = read_log(a.log)
    n = a.to
    fl = max(a.start, last_flush_before(entries, n))
    if not 0 <= a.start <= n <= len(entries):
        sys.exit("bad range %d..%d (%d entries)" % (a.start, n, len(entries)))
    apply(a.log, ssize, entries[a.start:fl], a.cur)
    with open(a.cur, "rb") as src, open(a.pt, "wb") as dst:
        # Sparse copy: skip all-zero blocks
        blk = 1 << 16
        zero = bytes(blk)
        while True:
            b = src.read(blk)
            if not b:
                break
            if b == zero:
                dst.seek(len(b), 1)
            else:
                dst.write(b)
        dst.truncate()
    apply(a.log, ssize, chosen(entries, fl, n, a.unflushed, a.seed), a.pt)


def cmd_plan(a):
    """Crash points: at each flush (before it with every write applied,
    just after it), half-way between two flushes, and a random subset of
    the writes since the last flush just before the next one. At most
    --max of them, evenly spread over the log."""
    _, entries = read_log(a.log)
    flushes = [e.index for e in entries if e.flags & FLUSH]
    pts = []
    prev = 0
    for f in flushes + [len(entries)]:
        writes = [e for e in entries[prev:f] if e.is_write()]
        if writes:
            mid = writes[len(writes) // 2].index
            pts.append((mid, "all"))
            pts.append((f, "all"))
            if len(writes) > 1:
                pts.append((f, "random"))
        if f < len(entries):
            pts.append((f + 1, "all"))
        prev = f + 1
    seen = set()
    uniq = []
    for p in pts:
        if p not in seen and p[0] > 0:
            seen.add(p)
            uniq.append(p)
    if a.max and len(uniq) > a.max:
        step = len(uniq) / a.max
        uniq = [uniq[int(k * step)] for k in range(a.max)]
    marks = [(e.index, e.mark) for e in entries if e.mark is not None]
    rng = random.Random(a.seed)
    for n, mode in uniq:
        acked = [m for i, m in marks if i < n]
        print("%d %d %s %d %s" % (n, last_flush_before(entries, n), mode,
                                  rng.randrange(1 << 30),
                                  acked[-1] if acked else "-"))


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("list")
    s.add_argument("log")
    s.set_defaults(fn=cmd_list)
    s = sub.add_parser("replay")
    s.add_argument("log")
    s.add_argument("img")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--to", type=int)
    g.add_argument("--mark")
    s.add_argument("--from", dest="start", type=int, default=0)
    s.add_argument("--unflushed", choices=("all", "none", "random"),
                   default="all")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_replay)
    s = sub.add_parser("point")
    s.add_argument("log")
    s.add_argument("cur")
    s.add_argument("pt")
    s.add_argument("--from", dest="start", type=int, default=0)
    s.add_argument("--to", type=int, required=True)
    s.add_argument("--unflushed", choices=("all", "none", "random"),
                   default="all")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_point)
    s = sub.add_parser("plan")
    s.add_argument("log")
    s.add_argument("--max", type=int, default=0)
    s.add_argument("--seed", type=int, default=1)
    s.set_defaults(fn=cmd_plan)
    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
