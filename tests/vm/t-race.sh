# shellcheck shell=bash
# A guest racing itself: in-place writes, discards, allocating writes and
# flushes in any order. Whatever the order, no guest byte may land in the
# image's metadata: a cluster that leaves the mappings is handed out
# again only after every bio mapped to it before has ended.
#
#   held_write_*  deterministic: one in-place write is held below the
#                 mapping (the test_hold message of the test_hooks module
#                 parameter) while its cluster is discarded, flushed and
#                 the next allocation wants a new L2 table; then it goes
#   stress_*      fio runs in-place writes, discards of the same region,
#                 allocating writes elsewhere (new L2 tables, refcount
#                 blocks) and flushes together, a few rounds; after each,
#                 qemu-img check, an untouched region, device == image
#   cache_full_waiters  128 allocating writers on a 64-slice cache
#   cache_waiter_dirty  deterministic: a load waits while every slice is
#                 pinned (test_pin_cache), the slices come back dirty
#                 (test_unpin_cache_dirty): the load must go on, no flush
#
# RACE_ROUNDS (or QCOW2_RACE_ROUNDS): stress rounds per case (default 2),
# RACE_SECONDS: fio seconds a round (default 12).

# shellcheck source=tests/vm/t-write.sh
. "$(dirname "${BASH_SOURCE[0]}")/t-write.sh"
for fn in $(declare -F | awk '{print $3}' | grep '^test_'); do
	unset -f "$fn"
done

RACE_ROUNDS=${RACE_ROUNDS:-${QCOW2_RACE_ROUNDS:-2}}
RACE_SECONDS=${RACE_SECONDS:-${QCOW2_RACE_SECONDS:-12}}
RACE_LOOP=/run/t-race-loop

# race_image KIND NAME MIB OPTS: an empty image of MIB MiB for backend
# KIND (file: a file in the case directory; bdev: a loop device over a
# sparse file), its path in RIMG.
race_image() {
	local kind=$1 name=$2 mib=$3 opts=$4 loop
	if [ "$kind" = file ]; then
		RIMG=$PWD/$name.qcow2
	else
		must truncate -s $((mib * 2))M "$PWD/$name.disk" || return 1
		loop=$(losetup -f --show --direct-io="${RACE_LOOP_DIO:-off}" \
			"$PWD/$name.disk") ||
			fail "losetup" || return 1
		echo "$loop" >>"$RACE_LOOP"
		RIMG=$loop
	fi
	must qemu-img create -q -f qcow2 -o "$opts" "$RIMG" "${mib}M"
}

race_cleanup() {
	local l
	wdev_cleanup
	[ -e "$RACE_LOOP" ] || return 0
	while read -r l; do
		losetup -d "$l" 2>/dev/null
	done <"$RACE_LOOP"
	rm -f "$RACE_LOOP"
}

# host_of IMG OFFSET: the host offset of guest byte OFFSET (qemu-img map).
host_of() {
	qemu-img map -U --output=json "$1" | python3 -c '
import json, sys
off = int(sys.argv[1])
for e in json.load(sys.stdin):
    if e["start"] <= off < e["start"] + e["length"] and "offset" in e:
        print(e["offset"] + off - e["start"]); break
' "$2"
}

# l2_of IMG L1_INDEX: the L2 table offset in that L1 entry, on disk.
l2_of() {
	local l1
	[ ! -b "$1" ] || blockdev --flushbufs "$1"
	l1=$(od -An -tu8 --endian=big -j 40 -N 8 "$1" | tr -d ' ')
	echo $(($(od -An -tu8 --endian=big -j $((l1 + 8 * $2)) -N 8 "$1" |
		tr -d ' ') & 0x00fffffffffffe00))
}

hooks() {
	echo "$1" >/sys/module/dm_qcow2/parameters/test_hooks
}

# wait_held SECONDS: the kernel log says the test hook holds a write.
wait_held() {
	local n=$(($1 * 10))
	while ! dmesg | tail -n 20 | grep -q 'test hook: holding write'; do
		n=$((n - 1))
		[ $n -gt 0 ] || fail "the write was never held" || return 1
		sleep 0.1
	done
}

# held_write KIND: 64 KiB clusters, 2 GiB: the L2 table mapping the first
# 512 MiB exists, guest cluster 1 MiB is allocated in place (host H). A
# 4 KiB write of 0xff to it is held after ->map() mapped it; the cluster
# is discarded and flushed (its refcount may drop), then a write at 1 GiB
# needs a new L2 table and a cluster for its data, and is flushed. Then
# the held write goes. It must land where nothing refers to any more,
# never in the new table: the image checks clean, 1 GiB reads back its
# data, 1 MiB reads as zeros. (Before the fix the new table went at H,
# the lowest free cluster, and the released write overwrote it.)
held_write() {
	local kind=$1 h l2 pid rc=0
	newdir hw || return 1
	trap race_cleanup EXIT
	race_image "$kind" hw 2048 cluster_size=64k || return 1
	must qemu-io -f qcow2 -c "write -P 0x11 1M 64k" "$RIMG" || return 1
	h=$(host_of "$RIMG" $((1 << 20)))
	[ -n "$h" ] || fail "test premise: 1 MiB not allocated" || return 1
	wdev_create hw "$RIMG" || return 1
	hooks 1 || fail "no test_hooks parameter" || return 1
	must dmsetup message hw 0 test_hold 2048 || return 1
	head -c 4096 /dev/zero | tr '\0' '\377' >ff.bin
	dd if=ff.bin of="$WDEV" bs=4k seek=256 oflag=direct conv=notrunc \
		status=none 2>dd.err &
	pid=$!
	wait_held 60 || { must dmsetup message hw 0 test_release; return 1; }
	must blkdiscard -o $((1 << 20)) -l 65536 "$WDEV" &&
		must fsync_path "$WDEV" || return 1
	head -c 65536 /dev/urandom >b.bin &&
		must dd if=b.bin of="$WDEV" bs=64k seek=$((16 << 10)) \
			oflag=direct conv=notrunc status=none &&
		must fsync_path "$WDEV" || return 1
	l2=$(l2_of "$RIMG" 2)
	log "held write's cluster at $h; new L2 table at $l2"
	[ "$l2" -ne "$h" ] || fail "the new L2 table took the cluster of a write in flight" ||
		rc=1
	must dmsetup message hw 0 test_release || return 1
	bg_wait_pid $pid 60 || return 1
	[ ! -s dd.err ] || fail "held write: $(cat dd.err)" || return 1
	must fsync_path "$WDEV" || return 1
	cmp b.bin <(dd if="$WDEV" bs=64k skip=$((16 << 10)) count=1 \
		iflag=direct status=none) || fail "1 GiB reads back wrong" || rc=1
	hooks 0
	wdev_remove hw || return 1
	[ ! -b "$RIMG" ] || blockdev --flushbufs "$RIMG"
	img_check "$RIMG" || return 1
	qio -r -f qcow2 -c "read -P 0 1M 64k" "$RIMG" || return 1
	[ $rc -eq 0 ] || return 1
	must qemu-img convert -f qcow2 -O raw "$RIMG" back.raw || return 1
	cmp b.bin <(dd if=back.raw bs=64k skip=$((16 << 10)) count=1 \
		status=none) || fail "1 GiB differs in the image" || return 1
	cd .. && rm -rf hw
}

# bg_wait_pid PID SECONDS: a background job ends within SECONDS.
bg_wait_pid() {
	local n=$(($2 * 10))
	while [ $n -gt 0 ] && kill -0 "$1" 2>/dev/null; do
		sleep 0.1
		n=$((n - 1))
	done
	kill -0 "$1" 2>/dev/null && { fail "pid $1 still running"; return 1; }
	wait "$1"
}

test_held_write_file()	{ held_write file; }
test_held_write_bdev()	{ held_write bdev; }

# stress_fio DEV: in-place writes over region A (0-64 MiB, allocated
# before), discards of random 64 KiB ranges of A, allocating writes over
# region B (128-384 MiB, empty: new L2 tables and refcount blocks), each
# writer flushing every few writes, all at once for RACE_SECONDS.
stress_fio() {
	fio --filename="$1" --direct=1 --ioengine=libaio --time_based \
		--runtime="$RACE_SECONDS" --group_reporting --randrepeat=0 \
		--name=inplace --rw=randwrite --offset=0 --size=64M \
		--bssplit=4k/50:16k/20:64k/30 --iodepth=8 --fsync=16 \
		--name=trim --ioengine=psync --rw=randtrim --offset=0 --size=64M \
		--bs=64k \
		--name=alloc --rw=randwrite --offset=128M --size=256M \
		--bssplit=4k/40:64k/60 --iodepth=8 --fsync=32
}

# stress KIND CLUSTER: RACE_ROUNDS rounds of stress_fio on a 384 MiB
# image; region C (96-128 MiB) is written once before and never again.
# After each round: C reads back through the device, the device's content
# is kept, and once the device is removed the image checks clean, equals
# that content, and C is intact in it.
stress() {
	local kind=$1 cs=$2 round
	newdir st || return 1
	trap race_cleanup EXIT
	race_image "$kind" st 384 "cluster_size=$cs" || return 1
	must qemu-io -f qcow2 -c "write -P 0x22 0 64M" \
		-c "write -P 0x5c 96M 32M" "$RIMG" || return 1
	for round in $(seq "$RACE_ROUNDS"); do
		wdev_create st "$RIMG" || return 1
		stress_fio "$WDEV" >fio.out 2>&1 ||
			{ tail -n 20 fio.out >&2; fail "fio, round $round"; return 1; }
		log "round $round: $(grep -E '^ *(write|trim): IOPS' fio.out |
			tr -s ' ' | cut -d, -f1 | tr '\n' ' ')"
		qio -r -f raw -t none -c "read -P 0x5c 96M 32M" "$WDEV" ||
			fail "C changed on the device, round $round" || return 1
		must fsync_path "$WDEV" || return 1
		must dd if="$WDEV" of=dev.raw bs=1M iflag=direct status=none ||
			return 1
		wdev_remove st || return 1
		[ ! -b "$RIMG" ] || blockdev --flushbufs "$RIMG"
		img_check "$RIMG" || return 1
		must qemu-img compare -U -q -f raw -F qcow2 dev.raw "$RIMG" ||
			fail "the image differs from the device, round $round" ||
			return 1
		qio -r -f qcow2 -c "read -P 0x5c 96M 32M" "$RIMG" ||
			fail "C changed in the image, round $round" || return 1
		rm -f dev.raw
	done
	cd .. && rm -rf st
}

test_stress_file_4k()	{ stress file 4k; }
test_stress_file_64k()	{ stress file 64k; }
test_stress_bdev_4k()	{ stress bdev 4k; }
test_stress_bdev_64k()	{ stress bdev 64k; }

# Many allocating writers racing for a small cache: 64 slices (the least
# cache_size allows), 4 KiB clusters, every L2 table of 1 GiB allocated
# by qemu, 128 random 4 KiB writes in flight, no flush. Loaders that find
# every slice pinned (others loading) wait; when those slices come back
# dirty, only writeback makes room, and it must be started then: before,
# such a loader slept until the next flush, and with every write waiting
# none came. The writes must all complete within the timeout. A guard: it
# did not catch the code before the fix in the one run made (the window
# is narrow: every loader that waits while some slice is dirty starts
# the writeback itself).
test_cache_full_waiters() {
	local pid rc=0 cmds=() r
	newdir cw || return 1
	trap race_cleanup EXIT
	# Metadata reads reach the disk: loads take long, and overlap
	RACE_LOOP_DIO=on race_image bdev cw 1024 cluster_size=4k || return 1
	for r in $(seq 0 511); do
		cmds+=(-c "write -z $((r << 21)) 4k")
	done
	must qemu-io -f qcow2 "${cmds[@]}" "$RIMG" || return 1
	echo 3 >/proc/sys/vm/drop_caches
	DM_LEN=$((1 << 21)) dm_create cw "$RIMG 2 cache_size 256k" || return 1
	fio --filename=/dev/mapper/cw --direct=1 --ioengine=libaio \
		--name=w --rw=randwrite --bs=4k --iodepth=128 --size=1G \
		--number_ios=3000 --randrepeat=0 >fio.out 2>&1 &
	pid=$!
	bg_wait_pid $pid 240 || rc=$?
	if [ $rc -ne 0 ]; then
		echo w >/proc/sysrq-trigger
		must dmsetup message cw 0 flush
		bg_wait_pid $pid 120
		fail "writes stalled with the cache full (see the blocked tasks)"
		return 1
	fi
	log "$(grep -E '^ *write: IOPS' fio.out | tr -s ' ' | cut -d, -f1), cache $(dm_status_field cw 4), evictions $(dm_status_field cw 7)"
	must fsync_path /dev/mapper/cw || return 1
	dm_remove cw || return 1
	img_check "$RIMG" || return 1
	cd .. && rm -rf cw
}

# A load that waits for room while every slice of a full cache is pinned
# and clean must go on when the slices come back dirty, without a flush:
# writeback is started then (before, the loader slept until the next
# flush). 64 slices (cache_size 256k), 65 regions of 32 MiB (one 4 KiB
# slice of L2 entries each) allocated by qemu; 64 of them read (their
# slices cached), all pinned by the test hook; a read of the 65th waits;
# the slices are released dirty; the read must end within 30 s.
test_cache_waiter_dirty() {
	local pid cmds=() r n
	newdir cd || return 1
	trap race_cleanup EXIT
	race_image file cd 4096 cluster_size=64k || return 1
	for r in $(seq 0 64); do
		cmds+=(-c "write -P 0x$((r % 90 + 10)) $((r << 25)) 4k")
	done
	must qemu-io -f qcow2 "${cmds[@]}" "$RIMG" || return 1
	wdev_create cd "$RIMG" || return 1
	must dmsetup message cd 0 cache_size 256k || return 1
	hooks 1 || fail "no test_hooks parameter" || return 1
	for r in $(seq 0 63); do
		must dd if="$WDEV" of=/dev/null bs=4k skip=$((r << 13)) count=1 \
			iflag=direct status=none || return 1
	done
	must dmsetup message cd 0 test_pin_cache || return 1
	n=$(dmesg | tail -n 5 | sed -n 's/.*test hook: \([0-9]*\) slices pinned.*/\1/p' |
		tail -n 1)
	log "pinned ${n:-?} slices"
	[ "${n:-0}" -ge 64 ] || fail "test premise: the cache is not full" || {
		must dmsetup message cd 0 test_unpin_cache_dirty
		return 1
	}
	dd if="$WDEV" of=/dev/null bs=4k skip=$((64 << 13)) count=1 \
		iflag=direct status=none &
	pid=$!
	sleep 2
	if ! kill -0 $pid 2>/dev/null; then
		must dmsetup message cd 0 test_unpin_cache_dirty
		fail "test premise: the read did not wait for room"
		return 1
	fi
	must dmsetup message cd 0 test_unpin_cache_dirty || return 1
	if ! bg_wait_pid $pid 30; then
		must fsync_path "$WDEV"
		bg_wait_pid $pid 60
		fail "the read waited for a flush with every slice dirty"
		return 1
	fi
	hooks 0
	qio -r -f raw -t none -c "read -P 0x$((64 % 90 + 10)) $((64 << 25)) 4k" \
		"$WDEV" || return 1
	wdev_remove cd || return 1
	img_check "$RIMG" || return 1
	cd .. && rm -rf cd
}
