#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
# A/B of two dm-qcow2 builds in one guest, for a change whose effect is
# smaller than the spread between guest runs under TCG: the modules are
# loaded in turn, each round, and each is measured against loop on a raw
# file in the same round. Runs in a scripts/vm-run guest with a scratch
# disk (/dev/vda, formatted here):
#
#   scripts/vm-run --disk 4G --out DIR -- tests/vm/ab-dd.sh A.ko B.ko [ROUNDS]
#
# The .ko files must be readable in the guest (not under /tmp, which is
# the guest's own). Each round and module: create the device on a
# preallocated 1 GiB image, a 100 MB dsync dd just after create (slices
# not cached), the same into loop, the dd again (slices cached), then the
# stats message. Each dd line gives MB/s and the guest's system CPU
# seconds (system, irq and softirq ticks) it took.
set -u
a=$1 b=$2 rounds=${3:-3}
mnt=/run/ab-dd
[ -b /dev/vda ] || { echo "ab-dd: no scratch disk /dev/vda" >&2; exit 2; }
modprobe dm-mod && modprobe loop || exit 1
mkdir -p "$mnt" &&
	mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 /dev/vda &&
	mount /dev/vda "$mnt" && cd "$mnt" || exit 1
qemu-img create -q -f qcow2 p.qcow2 1G &&
	qemu-io -c "write -P 0x11 0 1G" p.qcow2 >/dev/null &&
	dd if=/dev/zero of=r.raw bs=1M count=1024 conv=fsync status=none &&
	head -c 100M /dev/urandom >/run/ab-dd.bin || exit 1
sync

ticks() {
	awk '/^cpu /{ print $4 + $7 + $8 }' /proc/stat
}

# one_dd LABEL DEV
one_dd() {
	local t0 t1 c0 c1
	sync
	echo 3 >/proc/sys/vm/drop_caches
	sleep 1
	c0=$(ticks) t0=$(date +%s.%N)
	dd if=/run/ab-dd.bin of="$2" bs=100M count=1 oflag=dsync status=none ||
		return 1
	t1=$(date +%s.%N) c1=$(ticks)
	echo "$1 $(echo "$t0 $t1 $c0 $c1" | awk '{ printf "%.1f MB/s sys %.2f s",
		104.8576 / ($2 - $1), ($4 - $3) / 100 }')"
}

for i in $(seq 1 "$rounds"); do
	for m in A B; do
		ko=$a
		[ $m = B ] && ko=$b
		insmod "$ko" || exit 1
		dmsetup create ab --table "0 2097152 qcow2 $mnt/p.qcow2" || exit 1
		lo=$(losetup --direct-io=on -f --show r.raw) || exit 1
		one_dd "round $i $m dm cold" /dev/mapper/ab || exit 1
		one_dd "round $i $m loop" "$lo" || exit 1
		one_dd "round $i $m dm warm" /dev/mapper/ab || exit 1
		echo "round $i $m stats $(dmsetup message ab 0 stats)"
		losetup -d "$lo" && dmsetup remove ab && rmmod dm_qcow2 || exit 1
	done
done
