#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-only
"""Benchmark records and report (see tests/vm/bench-guest.sh, scripts/bench).

  bench-report.py report DIR          tables, CSV, JSON, chart from DIR/raw
  bench-report.py record fio|dd OUTPUT key=value...   one record (a test)

A record holds what one run did: IOPS, MB/s (10^6 bytes/s), I/Os done,
CPU ticks spent in the whole guest while it ran, and the dm-qcow2 cache
memory ("cache_bytes/cache_max_bytes" from dmsetup status) after it.
"""
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from collections import defaultdict

DEVS = ["dm-file", "dm-loop", "loop-raw", "qemu-nbd"]
# The devices by their short names in the ratio keys ("dm-file/nbd")
DEV_OF = {"dm-file": "dm-file", "dm-loop": "dm-loop", "loop": "loop-raw",
          "nbd": "qemu-nbd"}
NOTE = ("These figures come from a guest under emulation (TCG) on a small "
        "host: the absolute figures mean little, the ratios between targets "
        "measured in the same guest run are what count.")


def parse_fio(path):
    with open(path) as f:
        text = f.read()
    # fio may print warnings before the JSON document
    data = json.loads(text[text.index("{"):])
    job = data["jobs"][0]
    ios = 0
    bw = 0
    iops = 0.0
    runtime = 0
    for d in ("read", "write"):
        ios += job[d]["total_ios"]
        bw += job[d]["io_bytes"]
        iops += job[d]["iops"]
        runtime = max(runtime, job[d]["runtime"])
    secs = runtime / 1000.0
    return {"iops": iops, "mbps": bw / secs / 1e6 if secs else 0.0,
            "ios": ios, "secs": secs,
            "fio_usr_pct": job.get("usr_cpu"), "fio_sys_pct": job.get("sys_cpu")}


def parse_dd(path):
    with open(path) as f:
        text = f.read()
    m = re.search(r"(\d+) bytes .*copied, ([0-9.e+-]+) s", text)
    recs = re.search(r"(\d+)\+(\d+) records out", text)
    if not m:
        raise ValueError("no dd summary in %s: %s" % (path, text[-200:]))
    nbytes, secs = int(m.group(1)), float(m.group(2))
    ios = int(recs.group(1)) + int(recs.group(2)) if recs else 0
    return {"iops": ios / secs if secs else 0.0,
            "mbps": nbytes / secs / 1e6 if secs else 0.0,
            "ios": ios, "secs": secs}


def cmd_record(args):
    print(json.dumps(make_record(args[0], args[1], args[2:]), sort_keys=True))


def load_raw(d):
    """The records of the runs left by bench-guest.sh in DIR/raw."""
    recs = []
    raw = os.path.join(d, "raw")
    for name in sorted(os.listdir(raw)):
        if not name.endswith(".meta"):
            continue
        with open(os.path.join(raw, name)) as f:
            meta = f.read().split()
        kv = dict(a.split("=", 1) for a in meta)
        recs.append(make_record(kv["kind"], os.path.join(raw, name[:-5] + ".out"),
                                meta))
    return recs


def make_record(kind, path, args):
    meta = dict(a.split("=", 1) for a in args)
    rec = {"kind": kind, "state": meta["state"], "dev": meta["dev"],
           "wl": meta["wl"], "rc": int(meta.get("rc", 0))}
    try:
        rec.update(parse_fio(path) if kind == "fio" else parse_dd(path))
    except (ValueError, KeyError, IndexError, OSError) as e:
        rec["error"] = str(e)[:300]
    hz = float(meta.get("hz", 100))
    rec["usr_s"] = int(meta.get("usr_ticks", 0)) / hz
    rec["sys_s"] = int(meta.get("sys_ticks", 0)) / hz
    # The steady window of the run (see cpu_window in bench-guest.sh)
    for k in ("win_cs", "win_usr", "win_sys", "win_sectors", "bs"):
        if meta.get(k, "").lstrip("-").isdigit():
            rec[k] = int(meta[k])
    if rec.get("win_sectors", 0) > 0 and rec.get("bs"):
        uios = rec["win_sectors"] * 512.0 / rec["bs"]
        rec["win_ios"] = uios
        rec["sys_us_per_io"] = rec["win_sys"] / hz * 1e6 / uios
        rec["usr_us_per_io"] = rec["win_usr"] / hz * 1e6 / uios
    cache = meta.get("cache", "-")
    if "/" in cache:
        used, cmax = cache.split("/")
        rec["cache_bytes"], rec["cache_max"] = int(used), int(cmax)
    for k in ("start_cs", "wall", "round"):
        if meta.get(k, "").isdigit():
            rec[k] = int(meta[k])
    return rec


# ---- report --------------------------------------------------------------

def run_info(d):
    """How the run was made: bench-host.txt (scripts/bench: the command
    line, the date, the host), vm-run.log (the accelerator vm-run chose)
    and bench-env.txt (the guest: mode, sizes, kernel, CPUs, tools)."""
    info = {"tools": []}
    for name in ("bench-host.txt", "bench-env.txt"):
        p = os.path.join(d, name)
        if not os.path.exists(p):
            continue
        with open(p) as f:
            for line in f.read().splitlines():
                line = line.strip()
                if line.startswith(("command=", "disk=", "date=")):
                    k, v = line.split("=", 1)
                    info[k] = v
                elif line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                elif line.startswith(("fio-", "qemu-nbd")):
                    info["tools"].append(line)
                else:
                    for tok in line.split():
                        k, _, v = tok.partition("=")
                        info[k] = v or "yes"
    p = os.path.join(d, "vm-run.log")
    if os.path.exists(p):
        with open(p) as f:
            m = re.search(r"\(kernel [^,]+, (kvm|tcg)\)", f.read())
        if m:
            info["accel"] = m.group(1)
    return info


def env_lines(info):
    """The opening list of the report: command line, machine, run."""
    def g(k, unit=""):
        return info[k] + unit if info.get(k) else "not recorded"
    accel = {"tcg": "TCG (emulation, no KVM)", "kvm": "KVM"}.get(
        info.get("accel"), "accelerator not recorded")
    runs = "%s mode, %s MiB images, %s runs, %s round%s" % (
        g("mode"), g("size_mb"), g("runtime", " s"), g("rounds"),
        "" if info.get("rounds") == "1" else "s")
    if info.get("profiled"):
        runs += ", profiled with perf (its cost is in every figure)"
    host = "; host: %s cores" % info["host_cpus"] \
        if info.get("host_cpus") else ""
    return [
        "Command: %s%s" % ("`%s`" % info["command"] if info.get("command")
                           else "not recorded",
                           ", " + info["date"] if info.get("date") else ""),
        "Guest: Linux %s, %s vCPUs (%s), %s%s" % (
            g("kernel"), g("cpus"), g("cpu"), accel, host),
        "Scratch disk: %s" % g("disk"),
        "Runs: %s; guest time %s" % (runs, g("guest_seconds", " s")),
        "Tools: %s" % ("; ".join(info["tools"]) or "not recorded"),
    ]


def unit_of(wl):
    """Random 4 KiB workloads count IOPS, the rest MB/s."""
    return "IOPS" if "4k" in wl and not wl.startswith("dd-") else "MB/s"


def value_of(rec):
    if rec is None or "error" in rec or rec.get("rc", 0) != 0:
        return None
    return rec["iops"] if unit_of(rec["wl"]) == "IOPS" else rec["mbps"]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(v, digits=0):
    if v is None:
        return "-"
    if digits == 0:
        return "%.0f" % v if v >= 10 else "%.1f" % v
    return "%.*f" % (digits, v)


def sys_us_per_io(rec, usr=False):
    """From the steady window when there is one, else the whole run."""
    if rec is None:
        return None
    if "sys_us_per_io" in rec:
        return rec["sys_us_per_io"] + (rec["usr_us_per_io"] if usr else 0)
    if not rec.get("ios"):
        return None
    return (rec["sys_s"] + (rec["usr_s"] if usr else 0)) * 1e6 / rec["ios"]


def table(headers, rows):
    """Fixed-width text and markdown renderings of the same table."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    def line(r):
        return "  ".join(str(x).rjust(w) if i else str(x).ljust(w)
                         for i, (x, w) in enumerate(zip(r, widths)))
    txt = [line(headers), "  ".join("-" * w for w in widths)]
    txt += [line(r) for r in rows]
    md = ["| " + " | ".join(headers) + " |",
          "|" + "|".join("---" if i == 0 else "---:"
                         for i in range(len(headers))) + "|"]
    md += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(txt), "\n".join(md)


# Issue 6's targets: (what, state, workload regex, ratio key, at least)
TARGETS = [
    ("prealloc >= 0.95x loop-raw", "prealloc",
     r"^(rr4k-q32|rw4k-q32|sr1m|sw1m)$", "dm-file/loop", 0.95),
    ("empty 4 KiB randwrite >= 0.7x loop (sparse)", "empty",
     r"^rw4k-q32$", "dm-file/loop", 0.7),
    (">= 4x qemu-nbd, 4 KiB random", "prealloc|empty",
     r"^(rr|rw|rrw)4k-(q1|q32|j4|j16)$", "dm-file/nbd", 4.0),
    (">= 1.5x qemu-nbd, 1 MiB sequential", "prealloc|empty",
     r"^(sr1m|sw1m)$", "dm-file/nbd", 1.5),
    ("dd matrix >= 0.9x loop", "prealloc|empty", r"^dd-", "dm-file/loop",
     0.9),
]


def target_table(summary, big):
    """Each target against each run it covers: met, or short by how much."""
    heads = ["target", "state", "workload", "need", "dm-file", "dm-loop",
             "nbd/loop", "rounds", "met", "short by"]
    rows, out = [], []
    for what, states, wre, key, need in TARGETS:
        loop_key = key.replace("dm-file", "dm-loop")
        for s in summary:
            if not re.match("^(%s)$" % states, s["state"]) or \
                    not re.search(wre, s["workload"]):
                continue
            # Several rounds: the median of the rounds' own ratios
            judge = s["paired"] if s.get("paired", {}).get(key) is not None \
                else s["ratios"]
            got = judge.get(key)
            met = got is not None and got >= need
            short = None if got is None or met else (need - got) / need
            per = s.get("paired_rounds", {}).get(key, [])
            rows.append([what, s["state"], s["workload"], "%.2f" % need,
                         fmt(got, 2), fmt(judge.get(loop_key), 2),
                         fmt(judge.get("nbd/loop"), 2),
                         " ".join("%.2f" % x for x in per) or "-",
                         "-" if got is None else ("yes" if met else "no"),
                         "-" if short is None else "%.0f%%" % (short * 100)])
            out.append({"target": what, "state": s["state"],
                        "workload": s["workload"], "need": need, "got": got,
                        "met": met, "rounds": per,
                        "statistic": "paired median" if judge is
                        s.get("paired") else "ratio of medians"})
    for b in big:
        got = ratio(b["1T"], b["1G"])
        # ... and the cache within its bound (cache_size)
        cached = b["cache_1T"] is not None and b["cache_max"] is not None \
            and b["cache_1T"] <= b["cache_max"]
        met = got is not None and got >= 0.9 and cached
        rows.append(["1 TiB like 1 GiB (>= 0.9x, cache in bound)", "big",
                     b["workload"],
                     "0.90", fmt(got, 2), "-", "-", "-",
                     "-" if got is None else ("yes" if met else "no"),
                     "-" if got is None or met else
                     "%.0f%%" % ((0.9 - got) / 0.9 * 100) if got < 0.9
                     else "cache"])
        out.append({"target": "1 TiB like 1 GiB", "state": "big",
                    "workload": b["workload"], "need": 0.9, "got": got,
                    "met": met})
    t, m = table(heads, rows)
    return t, m, out


def target_summary(targets):
    """One line: how many target rows were met, and the short ones."""
    judged = [t for t in targets if t["got"] is not None]
    short = defaultdict(list)
    for t in judged:
        if not t["met"]:
            short[t["target"]].append("%s %s %.2f" % (t["state"], t["workload"],
                                                      t["got"]))
    line = "Met: %d of %d." % (sum(t["met"] for t in judged), len(judged))
    if short:
        line += " Short: " + "; ".join("%s: %s" % (k, ", ".join(v))
                                       for k, v in short.items()) + "."
    return line


def cmd_report(args):
    d = args[0]
    recs = load_raw(d)
    with open(os.path.join(d, "records.jsonl"), "w") as f:
        for r in recs:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    # Several rounds of a run: the median of each figure (see --rounds)
    runs = defaultdict(list)
    for r in recs:
        runs[(r["state"], r["dev"], r["wl"])].append(r)
    by = {k: v[-1] for k, v in runs.items()}
    nrounds = max([r.get("round", 1) for r in recs] + [1])

    def val(st, dv, wl):
        return median([value_of(r) for r in runs.get((st, dv, wl), [])])

    def cpu(st, dv, wl, usr=False):
        return median([sys_us_per_io(r, usr)
                       for r in runs.get((st, dv, wl), [])])

    def paired(st, a, b, wl):
        """a over b in each round both ran: the rounds' own ratios.

        Under emulation the host's speed moves over minutes; within a
        round a workload runs on the devices one after the other, so
        their ratio there is steadier than a ratio of two medians taken
        from different rounds."""
        other = {o.get("round", 1): value_of(o)
                 for o in runs.get((st, b, wl), [])}
        xs = [ratio(value_of(r), other.get(r.get("round", 1)))
              for r in runs.get((st, a, wl), [])]
        return [x for x in xs if x is not None]

    def spread(xs):
        return "%.2f-%.2f" % (min(xs), max(xs)) if xs else "-"

    order = []
    for r in recs:
        k = (r["state"], r["wl"])
        if r["state"] in ("prealloc", "empty") and k not in order:
            order.append(k)
    order.sort(key=lambda k: (k[0] != "prealloc",))

    env = ""
    p = os.path.join(d, "bench-env.txt")
    if os.path.exists(p):
        with open(p) as f:
            env = f.read().strip()
    info = run_info(d)

    ratio_cols = ["dm-file/loop", "dm-file/nbd", "dm-loop/loop",
                  "dm-loop/nbd", "nbd/loop"]
    headers = ["state", "workload", "unit"] + DEVS + ratio_cols
    if nrounds > 1:
        headers += ["dm-file/loop paired", "paired range",
                    "dm-file/nbd paired"]
    rows = []
    summary = []
    for st, wl in order:
        v = {dv: val(st, dv, wl) for dv in DEVS}
        rr = {
            "dm-file/loop": ratio(v["dm-file"], v["loop-raw"]),
            "dm-file/nbd": ratio(v["dm-file"], v["qemu-nbd"]),
            "dm-loop/loop": ratio(v["dm-loop"], v["loop-raw"]),
            "dm-loop/nbd": ratio(v["dm-loop"], v["qemu-nbd"]),
            "nbd/loop": ratio(v["qemu-nbd"], v["loop-raw"]),
        }
        row = [st, wl, unit_of(wl)] + [fmt(v[dv]) for dv in DEVS] + \
            [fmt(rr[k], 2) for k in ratio_cols]
        pr = {k: paired(st, DEV_OF[k.split("/")[0]],
                        DEV_OF[k.split("/")[1]], wl) for k in ratio_cols}
        pm = {k: median(x) for k, x in pr.items() if x}
        if nrounds > 1:
            row += [fmt(pm.get("dm-file/loop"), 2),
                    spread(pr["dm-file/loop"]),
                    fmt(pm.get("dm-file/nbd"), 2)]
        rows.append(row)
        summary.append({"state": st, "workload": wl, "unit": unit_of(wl),
                        "values": v, "ratios": rr, "rounds": nrounds,
                        "paired": pm if nrounds > 1 else {},
                        "paired_rounds": pr if nrounds > 1 else {}})
    main_txt, main_md = table(headers, rows)

    # CPU: system time of the whole guest per I/O, against loop-raw
    ch = ["state", "workload"] + ["%s us" % dv for dv in DEVS] + [
        "dm-file/loop", "dm-loop/loop", "nbd/loop", "nbd usr+sys us"]
    crows = []
    for st, wl in order:
        s = {dv: cpu(st, dv, wl) for dv in DEVS}
        tot = cpu(st, "qemu-nbd", wl, usr=True)
        crows.append([st, wl] + [fmt(s[dv], 1) for dv in DEVS] +
                     [fmt(ratio(s["dm-file"], s["loop-raw"]), 2),
                      fmt(ratio(s["dm-loop"], s["loop-raw"]), 2),
                      fmt(ratio(s["qemu-nbd"], s["loop-raw"]), 2),
                      fmt(tot, 1)])
    cpu_txt, cpu_md = table(ch, crows)

    # Cache memory of dm-qcow2 after each run
    mh = ["state", "workload", "dm-file cache", "dm-loop cache", "bound"]
    mrows = []
    for st, wl in order:
        a, b = by.get((st, "dm-file", wl)), by.get((st, "dm-loop", wl))
        bound = (a or b or {}).get("cache_max")
        mrows.append([st, wl,
                      str(a.get("cache_bytes", "-")) if a else "-",
                      str(b.get("cache_bytes", "-")) if b else "-",
                      str(bound if bound is not None else "-")])
    mem_txt, mem_md = table(mh, mrows)

    # 1 TiB against 1 GiB virtual size, same working set
    bh = ["workload", "1 GiB IOPS", "1 TiB IOPS", "1T/1G", "1 GiB cache",
          "1 TiB cache", "bound"]
    brows = []
    big = []
    for wl in sorted({r["wl"] for r in recs if r["state"].startswith("ws-")},
                     reverse=True):
        a, b = by.get(("ws-1G", "dm-file", wl)), by.get(("ws-1T", "dm-file", wl))
        va, vb = value_of(a), value_of(b)
        brows.append([wl, fmt(va), fmt(vb), fmt(ratio(vb, va), 2),
                      str((a or {}).get("cache_bytes", "-")),
                      str((b or {}).get("cache_bytes", "-")),
                      str((a or b or {}).get("cache_max", "-"))])
        big.append({"workload": wl, "1G": va, "1T": vb,
                    "cache_1G": (a or {}).get("cache_bytes"),
                    "cache_1T": (b or {}).get("cache_bytes"),
                    "cache_max": (a or b or {}).get("cache_max")})
    big_txt, big_md = table(bh, brows)

    tgt_txt, tgt_md, targets = target_table(summary, big)
    tgt_sum = target_summary(targets)

    errors = [r for r in recs if "error" in r or r.get("rc", 0) != 0]

    units = (
        "Units: IOPS for 4 KiB random fio runs, MB/s (10^6 bytes/s) for "
        "the rest. Ratios: a device's figure over loop-raw's (loop with "
        "direct I/O on a raw file: preallocated with data for 'prealloc', "
        "sparse for 'empty') and over qemu-nbd's (cache=none, aio=native, "
        "on the same qcow2 image), in the same state. With several rounds "
        "each figure is the median of the rounds and the ratio columns "
        "divide those medians; the 'paired' columns take the ratio "
        "within each round first and give the median of those (with the "
        "lowest and highest round). Under emulation the host's speed "
        "moves over minutes, and within a round a workload runs on the "
        "devices one after the other, so the paired median is the "
        "steadier figure: the targets are judged on it when there are "
        "several rounds.")
    # (title, what the table shows, text table, markdown table)
    sections = [
        ("Targets",
         "The targets of issue 6, judged on dm-file (the file backend). "
         "With several rounds each ratio is the median of the rounds' own "
         "ratios, listed under 'rounds'; 'short by' is how far below the "
         "target it is. Why the misses: Documentation/benchmarks/"
         "history.md.\n\n" + tgt_sum,
         tgt_txt, tgt_md),
        ("Throughput", units, main_txt, main_md),
        ("System CPU time per I/O",
         "Whole guest, microseconds, measured while the device is busy, "
         "away from the start and end of the run; qemu-nbd's user time is "
         "added in the last column. The guest's fixed costs (timer ticks, "
         "clock reads) are spread over the I/Os done: a run the host "
         "slowed shows more CPU per I/O for that reason alone, so compare "
         "devices here only where their throughput is alike.",
         cpu_txt, cpu_md),
        ("L2 cache memory",
         "dm-qcow2's L2 cache memory after each run, in bytes, and its "
         "bound.", mem_txt, mem_md),
        ("1 TiB vs 1 GiB virtual size",
         "dm-file, the same 256 MiB working set on a 1 GiB and a 1 TiB "
         "image.", big_txt, big_md),
    ]

    chart(d, summary)
    have_chart = os.path.exists(os.path.join(d, "chart.svg"))
    chart_text = ("chart.svg, beside this report: each device's ratio to "
                  "loop-raw per workload (log scale; with several rounds "
                  "the paired medians), and dm-file over qemu-nbd."
                  if have_chart else "No chart (gnuplot missing or failed).")

    # The command line and the machine first, then the targets, the
    # tables and the chart
    head = env_lines(info)
    txt = ["dm-qcow2 benchmark", "", "How it was run:"]
    txt += ["  " + x.replace("`", "") for x in head] + ["", NOTE, ""]
    md = ["# dm-qcow2 benchmark", "", "## How it was run", ""]
    md += ["- " + x for x in head] + ["", NOTE, ""]
    for title, text, t, m in sections:
        txt += [title + ": " + text, "", t, ""]
        md += ["## " + title, "", text, "", m, ""]
    if errors:
        txt.append("Failed runs:")
        md += ["## Failed runs", ""]
        for r in errors:
            s = "  %s %s %s: rc %s %s" % (r["state"], r["dev"], r["wl"],
                                          r.get("rc"), r.get("error", ""))
            txt.append(s.rstrip())
            md.append("-" + s[1:].rstrip())
        txt.append("")
        md.append("")
    txt.append("Chart: " + chart_text)
    md += ["## Chart", "", chart_text, ""]
    if have_chart:
        md += ["![dm-qcow2 over loop-raw and qemu-nbd](chart.svg)", ""]
    with open(os.path.join(d, "report.txt"), "w") as f:
        f.write("\n".join(txt) + "\n")
    with open(os.path.join(d, "report.md"), "w") as f:
        f.write("\n".join(md).rstrip("\n") + "\n")

    with open(os.path.join(d, "results.csv"), "w", newline="") as f:
        keys = ["state", "dev", "wl", "kind", "rc", "iops", "mbps", "ios",
                "secs", "wall", "start_cs", "usr_s", "sys_s", "sys_us_per_io",
                "usr_us_per_io",
                "cache_bytes", "cache_max", "error"]
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in recs:
            w.writerow(r)
    with open(os.path.join(d, "results.json"), "w") as f:
        json.dump({"note": NOTE, "env": env, "run": info, "records": recs,
                   "summary": summary, "big_image": big,
                   "targets": targets}, f, indent=1,
                  sort_keys=True)

    print("\n".join(txt))


def chart(d, summary):
    """Ratio to loop-raw of each device, per workload, log scale (SVG)."""
    dat = os.path.join(d, "chart.dat")
    with open(dat, "w") as f:
        f.write("# label dm-file dm-loop qemu-nbd dmfile/nbd\n")
        for s in summary:
            # Several rounds: the paired medians, as the targets use
            r = dict(s["ratios"], **s.get("paired", {}))
            vals = [r["dm-file/loop"], r["dm-loop/loop"], r["nbd/loop"],
                    r["dm-file/nbd"]]
            f.write("%s:%s %s\n" % ("pre" if s["state"] == "prealloc"
                                    else "empty", s["workload"],
                                    " ".join("NaN" if x is None else
                                             "%.4f" % x for x in vals)))
    if not shutil.which("gnuplot"):
        print("bench-report: no gnuplot, chart skipped", file=sys.stderr)
        return
    n = max(len(summary), 1)
    width = max(900, 28 * n + 200)
    body = """
set datafile missing 'NaN'
set style data histogram
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set logscale y 2
set grid ytics
set key outside top center horizontal
set xtics rotate by 45 right scale 0 font "sans,9"
set multiplot layout 2,1 title "dm-qcow2 benchmark: ratios in one guest run (TCG: absolute figures mean little)"
set title 'Ratio to loop on a raw file (1 = as fast as loop; log scale; several rounds: median of the per-round ratios)'
set arrow 1 from graph 0, first 1 to graph 1, first 1 nohead lw 2 lc rgb 'black' front
plot '%s' using 2:xtic(1) title 'dm-qcow2 file' lc rgb '#1f77b4', \\
     '' using 3 title 'dm-qcow2 on loop' lc rgb '#2ca02c', \\
     '' using 4 title 'qemu-nbd' lc rgb '#d62728'
set title 'dm-qcow2 (file backend) over qemu-nbd (above 1 = dm-qcow2 faster)'
plot '%s' using 5:xtic(1) title 'dm-qcow2 file / qemu-nbd' lc rgb '#9467bd'
unset multiplot
""" % (dat, dat)
    gp = ("set terminal svg size %d,900 dynamic background '#ffffff' "
          "font 'sans,11'\nset output '%s'\n" %
          (width, os.path.join(d, "chart.svg")) + body +
          "set terminal pngcairo size %d,900 background '#ffffff' "
          "font 'sans,10'\nset output '%s'\n" %
          (width, os.path.join(d, "chart.png")) + body)
    with open(os.path.join(d, "chart.gp"), "w") as f:
        f.write(gp)
    r = subprocess.run(["gnuplot", os.path.join(d, "chart.gp")],
                       capture_output=True, text=True)
    if r.returncode:
        print("bench-report: gnuplot failed: " + r.stderr[-500:],
              file=sys.stderr)


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("record", "report"):
        print(__doc__, file=sys.stderr)
        return 2
    if sys.argv[1] == "record":
        cmd_record(sys.argv[2:])
    else:
        cmd_report(sys.argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
