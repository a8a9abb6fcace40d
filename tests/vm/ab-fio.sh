#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
# A/B of two dm-qcow2 builds in one guest with an fio workload, as
# tests/vm/ab-dd.sh does with dd: the modules are loaded in turn, each
# round, and each is measured against loop on a raw file in the same round.
#
#   scripts/vm-run --disk 4G --out DIR -- tests/vm/ab-fio.sh A.ko B.ko \
#	[ROUNDS [FIO-ARGS...]]
#
# FIO-ARGS default to 4 KiB random writes at iodepth 1 for 5 s
# (--rw=randwrite --bs=4k --iodepth=1 --runtime=5); libaio, direct I/O on
# a preallocated 1 GiB image are always used. The .ko files must be
# readable in the guest (not under /tmp). Each run's line gives IOPS, the
# mean submission and completion latency (us) and the guest's system CPU
# per I/O (us: system, irq and softirq ticks over the run).
set -u
a=$1 b=$2 rounds=${3:-3}
shift $(($# < 3 ? $# : 3))
[ $# -gt 0 ] || set -- --rw=randwrite --bs=4k --iodepth=1 --runtime=5
mnt=/run/ab-fio
[ -b /dev/vda ] || { echo "ab-fio: no scratch disk /dev/vda" >&2; exit 2; }
modprobe dm-mod && modprobe loop || exit 1
mkdir -p "$mnt" &&
	mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 /dev/vda &&
	mount /dev/vda "$mnt" && cd "$mnt" || exit 1
qemu-img create -q -f qcow2 p.qcow2 1G &&
	qemu-io -c "write -P 0x11 0 1G" p.qcow2 >/dev/null &&
	dd if=/dev/zero of=r.raw bs=1M count=1024 conv=fsync status=none ||
	exit 1
sync

ticks() {
	awk '/^cpu /{ print $4 + $7 + $8 }' /proc/stat
}

# one_fio LABEL DEV
one_fio() {
	local c0 c1 out=$mnt/fio.json
	sync
	echo 3 >/proc/sys/vm/drop_caches
	sleep 1
	c0=$(ticks)
	fio --name=ab --filename="$2" --direct=1 --ioengine=libaio \
		--time_based --randrepeat=0 --norandommap \
		--output-format=json --output="$out" "${@:3}" >/dev/null 2>&1 ||
		return 1
	c1=$(ticks)
	python3 - "$1" "$out" "$c0" "$c1" <<'EOF'
import json, sys
label, path, c0, c1 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
text = open(path).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
ios = sum(job[d]["total_ios"] for d in ("read", "write"))
iops = sum(job[d]["iops"] for d in ("read", "write"))
d = max(("read", "write"), key=lambda k: job[k]["total_ios"])
lat = job[d]
print("%s %.0f IOPS slat %.0f clat %.0f us sys/io %.0f us" % (
    label, iops, lat["slat_ns"]["mean"] / 1000, lat["clat_ns"]["mean"] / 1000,
    (c1 - c0) * 1e4 / max(ios, 1)))
EOF
}

for i in $(seq 1 "$rounds"); do
	for m in A B; do
		ko=$a
		[ $m = B ] && ko=$b
		insmod "$ko" || exit 1
		dmsetup create ab --table "0 2097152 qcow2 $mnt/p.qcow2" || exit 1
		lo=$(losetup --direct-io=on -f --show r.raw) || exit 1
		one_fio "round $i $m dm" /dev/mapper/ab "$@" || exit 1
		one_fio "round $i $m loop" "$lo" "$@" || exit 1
		echo "round $i $m stats $(dmsetup message ab 0 stats)"
		losetup -d "$lo" && dmsetup remove ab && rmmod dm_qcow2 || exit 1
	done
done
