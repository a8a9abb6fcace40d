#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
# Does where an image lies cost large reads? In one guest, 1 MiB
# sequential reads (fio) and 100 MB direct dd reads on dm-qcow2 over the
# preallocated image, on loop over the bench's kind of raw file, and on
# loop over a second raw file at offset 320 KiB (where the qcow2 data
# starts) and at 1 MiB; then a profile of the dd reads and of 4 KiB random
# writes at iodepth 32 on dm-qcow2 and on loop. Each line gives the
# scratch disk's requests, their mean size and mean time on the disk:
# the same time per request on two files at different offsets, and a
# different one on another file, point at the files' places on the
# host's storage rather than at the device above them.
#
#   scripts/vm-run --disk 4G --out DIR -- tests/vm/place-check.sh M.ko [ROUNDS]
#
# The .ko must be readable in the guest (not under /tmp).
set -u
# shellcheck source=tests/vm/ab-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ko=$1 rounds=${2:-3}
ab_setup place
dd if=/dev/zero of=o.raw bs=1M count=1026 conv=fsync status=none || exit 1
sync
qemu-img map -U --output=json p.qcow2
for f in p.qcow2 r.raw o.raw; do
	filefrag -v "$f" | sed -n 1,6p
done
insmod "$ko" || exit 1
dmsetup create place --table "0 2097152 qcow2 $PWD/p.qcow2" || exit 1
dm=/dev/mapper/place
l0=$(losetup --direct-io=on -f --show r.raw) || exit 1
l320=$(losetup --direct-io=on -o 327680 --sizelimit 1073741824 -f --show \
	o.raw) || exit 1
l1m=$(losetup --direct-io=on -o 1048576 --sizelimit 1073741824 -f --show \
	o.raw) || exit 1

# disk_report LABEL WHAT STAT0 STAT1 FIO-JSON | T0 T1: the throughput
# from fio's report, or from one_dd's 1048.576 MB over T1 - T0
disk_report() {
	python3 - "$@" <<'PY'
import json, sys
label, what, s0, s1 = sys.argv[1:5]
# /sys/block/vda/stat: reads, merges, sectors, ms, then the same for writes
st = [int(y) - int(x) for x, y in zip(s0.split(), s1.split())]
reqs, sectors, ms = st[0] + st[4], st[2] + st[6], st[3] + st[7]
if len(sys.argv) == 6:
    text = open(sys.argv[5]).read()
    mbs = json.loads(text[text.index("{"):])["jobs"][0]["read"]["bw_bytes"] / 1e6
else:
    mbs = 1048.576 / (float(sys.argv[6]) - float(sys.argv[5]))
print("%s %s %.0f MB/s disk %d req %.0f KiB %.0f us" % (label, what, mbs,
      reqs, sectors / 2 / max(reqs, 1), ms * 1000 / max(reqs, 1)))
PY
}

# one_fio LABEL DEV: 1 MiB sequential reads, iodepth 4, 5 s
one_fio() {
	local d0 d1 out=$PWD/fio.json
	ab_quiesce
	d0=$(cat /sys/block/vda/stat)
	fio --name=place --filename="$2" --direct=1 --ioengine=libaio \
		--rw=read --bs=1m --iodepth=4 --size=1g --time_based \
		--runtime=5 --iomem_align=2m --output-format=json \
		--output="$out" >/dev/null 2>&1 || return 1
	d1=$(cat /sys/block/vda/stat)
	disk_report "$1" fio "$d0" "$d1" "$out"
}

# one_dd LABEL DEV: ten 100 MB direct reads (the bench's dd-r100M has five)
one_dd() {
	local d0 d1 t0 t1
	ab_quiesce
	d0=$(cat /sys/block/vda/stat) t0=$(date +%s.%N)
	dd if="$2" of=/dev/null bs=100M count=10 iflag=direct status=none ||
		return 1
	t1=$(date +%s.%N) d1=$(cat /sys/block/vda/stat)
	disk_report "$1" dd "$d0" "$d1" "$t0" "$t1"
}

for i in $(seq 1 "$rounds"); do
	one_dd "r$i dm-file" "$dm"
	one_dd "r$i loop@0" "$l0"
	one_dd "r$i loop@320K" "$l320"
	one_fio "r$i dm-file" "$dm"
	one_fio "r$i loop@0" "$l0"
	one_fio "r$i loop@320K" "$l320"
	one_fio "r$i loop@1M" "$l1m"
done

# prof LABEL CMD...: the symbols that took the samples while CMD ran
prof() {
	local label=$1
	shift
	ab_quiesce
	echo "== perf: $label"
	perf record -q -a -g -F 999 -e cpu-clock -o "$PWD/perf.data" -- \
		"$@" >/dev/null 2>&1
	perf report -i "$PWD/perf.data" --stdio --no-children -g none \
		--sort sym --percent-limit 0.7 2>/dev/null | grep -v '^#' |
		grep -v '^$'
}

for d in "$dm" "$l0"; do
	# shellcheck disable=SC2016 # $1 is the inner shell's
	prof "dd of 3000 MB from $d" sh -c 'for i in 1 2 3; do
		dd if="$1" of=/dev/null bs=100M count=10 iflag=direct \
			status=none; done' _ "$d"
	prof "4 KiB random writes, iodepth 32, on $d" fio --name=w \
		--filename="$d" --direct=1 --ioengine=libaio --rw=randwrite \
		--bs=4k --iodepth=32 --size=1g --time_based --runtime=8 \
		--randrepeat=0 --norandommap --iomem_align=2m \
		--output-format=terse --output="$PWD/w.terse"
	# terse format v3: field 49 is the write IOPS
	echo "IOPS $(cut -d';' -f49 "$PWD/w.terse")"
done
losetup -d "$l0" "$l320" "$l1m" && dmsetup remove place &&
	rmmod dm_qcow2
