#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
# A/B of two dm-qcow2 builds in one guest with an fio workload, as
# tests/vm/ab-dd.sh does with dd: the modules are loaded in turn, each
# round, and each is measured against loop on a raw file in the same round.
#
#   scripts/vm-run --fill --disk 4G --out DIR -- tests/vm/ab-fio.sh \
#	[--empty] [--bdev] A.ko B.ko [ROUNDS [FIO-ARGS...]]
#
# FIO-ARGS default to 4 KiB random writes at iodepth 1 for 5 s
# (--rw=randwrite --bs=4k --iodepth=1 --runtime=5); libaio, direct I/O on
# a preallocated 1 GiB image (--empty: a new empty image and a sparse raw
# file for every run, so that writes allocate; --bdev: the image served
# through a loop device, the block-device backend), and buffers on a 2 MiB
# boundary (huge pages, as the bench has them) are always used. The .ko
# files must be readable in the guest (not under /tmp). Each run's line
# gives IOPS, the mean submission and completion latency (us), the
# guest's system CPU per I/O (us: system, irq and softirq ticks over the
# run) and what the scratch disk under the image served: requests, their
# mean size (KiB) and mean time (us) on the disk: requests smaller than
# the I/O size, or longer times on the disk, show where a slower run's
# time went; then how long the disk was busy (ms), how many requests it
# held on average while busy, and how many flushes it served.
set -u
while :; do
	case ${1:-} in
	--empty) AB_EMPTY=1 ;;
	--bdev) AB_BDEV=1 ;;
	*) break ;;
	esac
	shift
done
# shellcheck source=tests/vm/ab-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
a=$1 b=$2 rounds=${3:-3}
shift $(($# < 3 ? $# : 3))
[ $# -gt 0 ] || set -- --rw=randwrite --bs=4k --iodepth=1 --runtime=5
fio_args=("$@")
ab_setup ab-fio

# one_fio LABEL DEV
one_fio() {
	local c0 c1 out=$PWD/fio.json
	local d0 d1
	ab_quiesce
	c0=$(ab_ticks)
	d0=$(cat /sys/block/vda/stat)
	fio --name=ab --filename="$2" --direct=1 --ioengine=libaio \
		--time_based --randrepeat=0 --norandommap --iomem_align=2m \
		--output-format=json --output="$out" "${fio_args[@]}" \
		>/dev/null 2>&1 || return 1
	c1=$(ab_ticks)
	d1=$(cat /sys/block/vda/stat)
	python3 - "$1" "$out" "$c0" "$c1" "$d0" "$d1" <<'PY'
import json, sys
label, path, c0, c1 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
# /sys/block/vda/stat: reads, merges, sectors, ms, then the same for writes
st = [int(y) - int(x) for x, y in zip(sys.argv[5].split(), sys.argv[6].split())]
reqs, sectors, ms = st[0] + st[4], st[2] + st[6], st[3] + st[7]
text = open(path).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
ios = sum(job[d]["total_ios"] for d in ("read", "write"))
iops = sum(job[d]["iops"] for d in ("read", "write"))
d = max(("read", "write"), key=lambda k: job[k]["total_ios"])
lat = job[d]
# then in flight, busy ms, ms waited in all, and (from 5.5 on) the flushes
busy, queued = st[9], st[10]
flushes = st[15] if len(st) > 15 else 0
print("%s %.0f IOPS slat %.0f clat %.0f us sys/io %.0f us"
      " disk %d req %.0f KiB %.0f us busy %d ms depth %.1f flush %d" % (
    label, iops, lat["slat_ns"]["mean"] / 1000, lat["clat_ns"]["mean"] / 1000,
    (c1 - c0) * 1e4 / max(ios, 1), reqs, sectors / 2 / max(reqs, 1),
    ms * 1000 / max(reqs, 1), busy, queued / max(busy, 1), flushes))
PY
}

# fio_round LABEL DM LOOP
fio_round() {
	one_fio "$1 dm" "$2" && one_fio "$1 loop" "$3"
}

ab_rounds "$a" "$b" "$rounds" fio_round
