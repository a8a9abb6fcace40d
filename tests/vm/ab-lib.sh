# SPDX-License-Identifier: GPL-2.0-only
# shellcheck shell=bash
# Shared by tests/vm/ab-dd.sh and tests/vm/ab-fio.sh: A/B of two dm-qcow2
# builds in one guest, the modules loaded in turn each round and each
# measured against loop on a raw file in the same round. Sourced.

# ab_setup NAME: format the scratch disk /dev/vda, mount it on /run/NAME
# and cd there; make p.qcow2 (1 GiB, every cluster allocated) and r.raw
# (1 GiB of zeros, written). With AB_EMPTY=1, ab_rounds() makes empty
# images instead, new for every measure (ab_images()).
AB_EMPTY=${AB_EMPTY:-}
# With AB_BDEV=1, the qcow2 image is served through a loop device (direct
# I/O) instead of as a file: the block-device backend, as the bench's
# dm-loop rows have it.
AB_BDEV=${AB_BDEV:-}
ab_setup() {
	local mnt=/run/$1
	[ -b /dev/vda ] || { echo "$1: no scratch disk /dev/vda" >&2; exit 2; }
	modprobe dm-mod && modprobe loop || exit 1
	mkdir -p "$mnt" &&
		mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 \
			/dev/vda &&
		mount /dev/vda "$mnt" && cd "$mnt" || exit 1
	[ -z "$AB_EMPTY" ] || return 0
	qemu-img create -q -f qcow2 p.qcow2 1G &&
		qemu-io -c "write -P 0x11 0 1G" p.qcow2 >/dev/null &&
		dd if=/dev/zero of=r.raw bs=1M count=1024 conv=fsync \
			status=none || exit 1
	sync
}

# System CPU ticks since boot: system, irq and softirq
ab_ticks() {
	awk '/^cpu /{ print $4 + $7 + $8 }' /proc/stat
}

# Before each measured run: nothing dirty, no page cache, a quiet second
ab_quiesce() {
	sync
	echo 3 >/proc/sys/vm/drop_caches
	sleep 1
}

# ab_images: the image pair a measure gets, in AB_QCOW2 and AB_RAW:
# p.qcow2 and r.raw, or with AB_EMPTY=1 a new empty qcow2 image and a
# sparse raw file (1 GiB each), where every write allocates. The empty
# image takes qemu-img's -o options from QCOW2_AB_OPTS (vm-run passes
# QCOW2_* into the guest), e.g. refcount_bits=64 for a new refcount
# block every 512 MiB of host clusters instead of every 2 GiB.
ab_images() {
	AB_QCOW2=p.qcow2 AB_RAW=r.raw
	[ -n "$AB_EMPTY" ] || return 0
	AB_QCOW2=e.qcow2 AB_RAW=e.raw
	rm -f e.qcow2 e.raw
	qemu-img create -q -f qcow2 ${QCOW2_AB_OPTS:+-o "$QCOW2_AB_OPTS"} \
		e.qcow2 1G && truncate -s 1G e.raw && sync
}

# ab_rounds A.ko B.ko ROUNDS MEASURE: each round and module, load the
# module, serve the qcow2 image of ab_images() (through a loop device with
# AB_BDEV=1) as /dev/mapper/ab and its
# raw file on a loop device (direct I/O), run MEASURE "round I M" DM-DEV
# LOOP-DEV, and take it all down again.
ab_rounds() {
	local a=$1 b=$2 rounds=$3 measure=$4 i m ko lo img qlo
	for i in $(seq 1 "$rounds"); do
		for m in A B; do
			ko=$a
			[ $m = B ] && ko=$b
			insmod "$ko" && ab_images || exit 1
			img=$PWD/$AB_QCOW2 qlo=
			if [ -n "$AB_BDEV" ]; then
				# room to allocate in: a device does not grow
				truncate -s 1312M "$img" &&
					qlo=$(losetup --direct-io=on -f --show "$img") ||
					exit 1
				img=$qlo
			fi
			dmsetup create ab --table "0 2097152 qcow2 $img" ||
				exit 1
			lo=$(losetup --direct-io=on -f --show "$AB_RAW") || exit 1
			"$measure" "round $i $m" /dev/mapper/ab "$lo" || exit 1
			losetup -d "$lo" && dmsetup remove ab &&
				rmmod dm_qcow2 || exit 1
			[ -z "$qlo" ] || losetup -d "$qlo" || exit 1
		done
	done
}
