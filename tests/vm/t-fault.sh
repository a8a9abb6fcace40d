# shellcheck shell=bash
# Faults from below: the device or file system under the image fails reads
# or writes, drops writes, or fills up; and the target is suspended,
# reloaded and removed under I/O.
#
# Faults come from dm-flakey (6.1: no feature = every bio fails while
# "down", error_writes, drop_writes; there is no error_reads, so read
# faults use the no-feature table while only reads are issued). Its table
# is swapped under live I/O (load, suspend --nolockfs, resume):
#   block-device backend:  loop -> flakey "fk" -> dm-qcow2 on /dev/mapper/fk
#   file backend:          loop -> flakey "fk" -> ext4 -> image file -> dm-qcow2
# What every case asserts: the bios that meet the fault fail; a failed
# metadata write or flush puts the target in fail mode (status mode
# "fail") and raises one dm event, and from then on every write and every
# flush fails, also once the device below works again (until the table is
# reloaded); a write or flush the target acknowledged (FUA/flush) is intact
# afterwards; after the fault is gone and the device removed, "qemu-img
# check" finds no corruption (leaks are allowed: a cluster taken for a
# write that failed).
#
# FAULT_FULL=1 (or QCOW2_FAULT_FULL=1) adds the longer cases (more
# suspend/reload cycles, a second backend for them).

# Reuse the write-path helpers (wdev_create, qio, img_check...) but not
# its cases.
# shellcheck source=tests/vm/t-write.sh
. "$(dirname "${BASH_SOURCE[0]}")/t-write.sh"
for fn in $(declare -F | awk '{print $3}' | grep '^test_'); do
	unset -f "$fn"
done

FAULT_FULL=${FAULT_FULL:-${QCOW2_FAULT_FULL:-}}
FK_STATE=/run/t-fault-fk

# ---- the faulty device ----------------------------------------------------

# fk_setup NAME SIZE: a sparse file in the case directory, a loop device
# over it and the dm device NAME over that, a flakey table that is never
# down for now. Sets FK_DEV.
fk_setup() {
	local name=$1 loop
	mkdir -p "$FK_STATE"
	must truncate -s "$2" "$PWD/$name.disk" || return 1
	loop=$(losetup -f --show "$PWD/$name.disk") || fail "losetup" || return 1
	echo "$loop" >"$FK_STATE/$name"
	dmsetup create "$name" --table "$(fk_table "$name" good)" ||
		fail "cannot create $name" || return 1
	dmsetup mknodes "$name"
	FK_DEV=/dev/mapper/$name
	trap wdev_cleanup EXIT
}

# fk_bdev NAME SIZE: fk_setup; FK_IMG is the block device for the image.
# (A direct-I/O loop device between flakey and the target would hide
# test_bdev_on_dm's bug but fails the target's 72-byte header read.)
fk_bdev() {
	fk_setup "$1" "$2" || return 1
	FK_IMG=$FK_DEV
}

# fk_table NAME MODE: the table for MODE over the loop device of NAME.
#   good    flakey, never down (up 1 s, down 0 s)
#   ewrite  flakey always down, error_writes: writes and flushes fail
#   drop    flakey always down, drop_writes: writes complete, never land
#   eall    flakey always down, no feature: every read and write fails
fk_table() {
	local loop sz
	loop=$(cat "$FK_STATE/$1")
	sz=$(blockdev --getsz "$loop")
	case $2 in
	good)	echo "0 $sz flakey $loop 0 1 0" ;;
	ewrite)	echo "0 $sz flakey $loop 0 0 1 1 error_writes" ;;
	drop)	echo "0 $sz flakey $loop 0 0 1 1 drop_writes" ;;
	eall)	echo "0 $sz flakey $loop 0 0 1" ;;
	esac
}

# fk_switch NAME MODE|TABLE: swap the live table. --nolockfs: a file
# system on it is not frozen (it may be failing; the fault must hit it
# live).
fk_switch() {
	local name=$1 tbl=$2
	case $tbl in
	good|ewrite|drop|eall) tbl=$(fk_table "$name" "$tbl") ;;
	esac
	timeout 60 dmsetup load "$name" --table "$tbl" &&
		timeout 60 dmsetup suspend --nolockfs "$name" &&
		timeout 60 dmsetup resume "$name" ||
		fail "cannot switch $name to '$2'"
}

fk_cleanup() {
	local f d
	for d in $(dmsetup ls --target qcow2 2>/dev/null | awk '$1 != "No" {print $1}'); do
		dmsetup remove --force "$d" >/dev/null 2>&1
	done
	mountpoint -q "$SCRATCH/fkmnt" 2>/dev/null && umount "$SCRATCH/fkmnt"
	for f in "$FK_STATE"/*; do
		[ -e "$f" ] || continue
		dmsetup remove "${f##*/}" >/dev/null 2>&1 ||
			dmsetup remove --force "${f##*/}" >/dev/null 2>&1
		losetup -d "$(cat "$f")" 2>/dev/null
		rm -f "$f"
	done
}

# wdev_create installs wdev_cleanup as the EXIT trap: extend it.
eval "tw_$(declare -f wdev_cleanup)"
wdev_cleanup() {
	tw_wdev_cleanup
	fk_cleanup
}

# fk_fs NAME SIZE: ext4 on a new faulty device NAME, mounted at
# $SCRATCH/fkmnt (FK_MNT).
FK_MNT=$SCRATCH/fkmnt
fk_fs() {
	fk_setup "$1" "$2" || return 1
	must mkfs.ext4 -q -F -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 \
		"$FK_DEV" || return 1
	mkdir -p "$FK_MNT"
	must mount -t ext4 -o noatime "$FK_DEV" "$FK_MNT"
}

# fk_fs_recover NAME: after the fault: unmount, good table, e2fsck
# (journal replay and repairs; exit 4 or more means it could not fix the
# file system), mount again: the image file is what the disk holds now.
fk_fs_recover() {
	local rc=0
	mountpoint -q "$FK_MNT" && { must umount "$FK_MNT" || return 1; }
	fk_switch "$1" good || return 1
	e2fsck -fy "$FK_DEV" >fsck.out 2>&1 || rc=$?
	log "e2fsck: exit $rc"
	[ $rc -lt 4 ] || { tail -n 20 fsck.out >&2; fail "e2fsck: exit $rc"; return 1; }
	must mount -t ext4 -o noatime "$FK_DEV" "$FK_MNT"
}

# ---- helpers ----------------------------------------------------------------

# be64 FILE OFFSET: the big-endian u64 at OFFSET.
be64() { od -An -tu8 --endian=big -j "$2" -N 8 "$1" | tr -d ' '; }

dm_events() { dmsetup info -c --noheadings -o events "$1"; }
dm_mode() { dm_status_field "$1" 1; }

# must_fail MSG CMD...: CMD fails and says MSG (an ERE).
must_fail() {
	local msg=$1 out
	shift
	if out=$("$@" 2>&1); then
		fail "succeeded despite the fault: $*"
		return 1
	fi
	echo "$out" | grep -qE -- "$msg" && return 0
	echo "$out" | tail -n 5 >&2
	fail "expected '$msg' from: $*"
}

# expect_event NAME EVENT_NR: a dm event after EVENT_NR comes within 20 s.
expect_event() {
	timeout 20 dmsetup wait "$1" "$2" >/dev/null 2>&1 ||
		fail "no dm event on $1 after event $2 (now $(dm_events "$1"))"
}

# no_corruption IMG: "qemu-img check" finds no corruption; leaked
# clusters are allowed (exit 3). Block devices are flushed and their page
# cache dropped first so that qemu reads what is on the disk.
no_corruption() {
	local rc=0
	[ ! -b "$1" ] || blockdev --flushbufs "$1"
	qemu-img check "$1" >check.out 2>&1 || rc=$?
	case $rc in
	0) log "qemu-img check: clean" ;;
	3) log "qemu-img check: $(grep -c 'Leaked cluster' check.out) leaked clusters, no corruption" ;;
	*) tail -n 20 check.out >&2; fail "qemu-img check: exit $rc"; return 1 ;;
	esac
}

# same_head FILE IMG: the image (qcow2) begins with FILE's bytes.
same_head() {
	[ ! -b "$2" ] || blockdev --flushbufs "$2"
	must qemu-img convert -f qcow2 -O raw "$2" back.raw || return 1
	cmp -n "$(stat -c %s "$1")" "$1" back.raw ||
		fail "data acknowledged before the fault differs" || return 1
	rm -f back.raw
}

# A: 8 MiB of random data written and flushed through the device.
write_a() {
	must dd if=/dev/urandom of=a.raw bs=1M count=8 status=none &&
		must dd if=a.raw of="$1" bs=1M oflag=direct conv=notrunc status=none &&
		must fsync_path "$1"
}

# bg_wait PID SECONDS: wait for a background job; a job still running
# after SECONDS is a hang: show the blocked tasks and fail.
bg_wait() {
	local pid=$1 n=$(($2 * 10))
	while [ $n -gt 0 ] && kill -0 "$pid" 2>/dev/null; do
		sleep 0.1
		n=$((n - 1))
	done
	if kill -0 "$pid" 2>/dev/null; then
		echo w >/proc/sysrq-trigger
		fail "pid $pid still running after $2 s (hang?)"
		return 2
	fi
	wait "$pid"
}

# fio_flushing DEV OFFSET SIZE IO_SIZE [FIO-ARGS...]: random writes of
# mixed sizes, allocating, with a flush every 8 writes.
fio_flushing() {
	fio --filename="$1" --direct=1 --ioengine=libaio --iodepth=8 \
		--bssplit=4k/30:16k/20:64k/30:256k/20 --name=w --rw=randwrite \
		--offset="$2" --size="$3" --io_size="$4" --fsync=8 "${@:5}"
}

# ---- 1. write faults ----------------------------------------------------------

# write_fault KIND: the image on the faulty device (bdev) or in ext4 on it
# (file). A is written and flushed; fio writes (and flushes) while the
# device starts failing every write: fio gets errors, the flush that
# meets the fault fails, the target enters fail mode and raises one event;
# reads still work and show A. When the device works again, writes,
# flushes and FUA writes still fail (a flush that passed now would say
# the writes lost in the fault were durable). Afterwards the image is not
# corrupt and holds A.
write_fault() {
	local kind=$1 img ev0 pid rc
	newdir wf || return 1
	if [ "$kind" = bdev ]; then
		fk_bdev fk 160M || return 1
		img=$FK_IMG
	else
		fk_fs fk 160M || return 1
		img=$FK_MNT/wf.qcow2
	fi
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	wdev_create wf "$img" || return 1
	write_a "$WDEV" || return 1
	ev0=$(dm_events wf)

	# Time-based, so that fio is still writing when the fault comes
	# however fast the host is (a fixed size can end before it)
	fio_flushing "$WDEV" 16M 40M 64M --time_based --runtime=100 \
		>fio.out 2>&1 &
	pid=$!
	sleep 2
	fk_switch fk ewrite || return 1
	rc=0
	bg_wait $pid 120 || rc=$?
	[ $rc -ne 2 ] || return 1
	[ $rc -ne 0 ] || fail "fio saw no error" || return 1
	grep -qE 'error|Input/output' fio.out || { tail -n 5 fio.out >&2;
		fail "fio failed without an I/O error"; return 1; }
	log "fio: $(grep -oE 'err= *[0-9]+[^,]*' fio.out | head -n 1)"

	# Overwriting A in place fails (data write to the faulty device)
	must_fail 'Input/output error' dd if=/dev/zero of="$WDEV" bs=64k \
		count=2 oflag=direct conv=notrunc || return 1
	# A flush cannot reach the disk: it fails; the target stops writing
	must_fail 'Input/output error' fsync_path "$WDEV" || return 1
	expect_event wf "$ev0" || return 1
	[ "$(dm_mode wf)" = fail ] ||
		fail "mode $(dm_mode wf) after a failed metadata write" || return 1
	log "mode $(dm_mode wf), events $ev0 -> $(dm_events wf)"
	# Below a file, the file system has shut down after the failed
	# writes and fails reads too: A is checked after its recovery
	if [ "$kind" = bdev ]; then
		cmp -n $((8 << 20)) a.raw "$WDEV" ||
			fail "A reads back wrong" || return 1
	fi

	# The fault goes; the target still does not trust the image
	if [ "$kind" = bdev ]; then
		fk_switch fk good || return 1
	fi
	must_fail 'Input/output error' dd if=/dev/zero of="$WDEV" bs=4k \
		count=1 seek=100 oflag=direct conv=notrunc || return 1
	must_fail 'Input/output error' dd if=/dev/zero of="$WDEV" bs=4k \
		count=1 seek=100 oflag=direct,dsync conv=notrunc || return 1
	must_fail 'Input/output error' fsync_path "$WDEV" || return 1
	must_fail 'Input/output error' dmsetup message wf 0 flush || return 1
	[ "$(dm_mode wf)" = fail ] ||
		fail "mode $(dm_mode wf) once the device works again" || return 1
	[ "$(dm_events wf)" -eq $((ev0 + 1)) ] ||
		fail "events $ev0 -> $(dm_events wf): want one" || return 1
	wdev_remove wf || return 1
	[ "$kind" = bdev ] || fk_fs_recover fk || return 1
	no_corruption "$img" || return 1
	same_head a.raw "$img" || return 1
	cd .. && rm -rf wf
}

test_write_fault_bdev()	{ write_fault bdev; }
test_write_fault_file()	{ write_fault file; }

# ---- 2. metadata write fails, data write succeeds ----------------------------

# The image's L2 table sits on an "error" segment; the rest of the device
# works. (flakey error_writes would fail flushes too, which are writes,
# and hide the case; the error target takes no flushes. Its reads fail
# too, so the L2 slice used is cached beforehand.) An allocating FUA write
# lands its data, then cannot write the L2 table: it must fail, not be
# acknowledged. Mode ro, an event; the image is not corrupt (the new
# cluster leaks) and A is intact.
test_meta_fault_bdev() {
	local img l1 l2 s0 ev0 loop sz
	newdir mf || return 1
	fk_bdev fk 128M || return 1
	img=$FK_IMG
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	# Allocate the one L2 table (64 KiB clusters: it maps 512 MiB)
	must qemu-io -f qcow2 -c "write -P 0x77 60M 64k" "$img" || return 1
	l1=$(be64 "$img" 40)
	l2=$(($(be64 "$img" "$l1") & 0x00fffffffffffe00))
	[ "$l2" -gt 0 ] || fail "test premise: no L2 table" || return 1
	log "L1 at $l1, L2 table at $l2"
	wdev_create mf "$img" || return 1
	write_a "$WDEV" || return 1	# caches the slice mapping 0-32 MiB
	ev0=$(dm_events mf)

	loop=$(cat "$FK_STATE/fk")
	sz=$(blockdev --getsz "$loop")
	s0=$((l2 / 512))
	fk_switch fk "0 $s0 linear $loop 0
$s0 128 error
$((s0 + 128)) $((sz - s0 - 128)) linear $loop $((s0 + 128))" || return 1
	must_fail 'Input/output error' dd if=/dev/urandom of="$WDEV" bs=4k \
		count=1 seek=$((16 << 8)) oflag=direct,dsync conv=notrunc ||
		return 1
	expect_event mf "$ev0" || return 1
	[ "$(dm_mode mf)" = fail ] ||
		fail "mode $(dm_mode mf) after a failed L2 write" || return 1
	log "mode $(dm_mode mf), events $ev0 -> $(dm_events mf)"
	fk_switch fk good || return 1
	wdev_remove mf || return 1
	no_corruption "$img" || return 1
	same_head a.raw "$img" || return 1
	qio -r -f qcow2 -c "read -P 0x77 60M 64k" "$img" || return 1
	cd .. && rm -rf mf
}

# unhang NAME PID: after a hang on NAME, give the target a working device
# and a flush that succeeds, so that the writeback it waits for happens
# and the suite can go on.
unhang() {
	log "unblocking $2: good table, flush"
	fk_switch fk good
	fsync_path "/dev/mapper/$1" &
	bg_wait "$2" 60
}

# A cache full of dirty L2 slices whose writeback fails: 120 L2 tables
# (4 KiB clusters, one per 2 MiB), laid out back to back by qemu, sit on a
# flakey segment failing writes and flushes; the cache holds 64 slices.
# Allocating writes in 100 regions dirty more slices than fit, so
# writeback runs and fails: the target goes read-only. Reads of regions
# whose slice is not cached must then complete (data or EIO) instead of
# waiting forever for room in the cache. If they hang, the test fails and
# unblocks them (good table, then a flush that succeeds) so that the
# suite can go on.
test_meta_fault_cache_full() {
	local img loop sz l2min=-1 l2max=0 r e cmds=() pid len rc s0 n l1 vlen
	newdir cf || return 1
	fk_bdev fk 128M || return 1
	img=$FK_IMG
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 512M ||
		return 1
	for r in $(seq 0 119); do
		cmds+=(-c "write -z $((r << 21)) 4k")
	done
	for r in $(seq 100 119); do
		cmds+=(-c "write -P 0x5c $(((r << 21) + 65536)) 4k")
	done
	must qemu-io -f qcow2 "${cmds[@]}" "$img" || return 1
	l1=$(be64 "$img" 40)
	for r in $(seq 0 119); do
		e=$(($(be64 "$img" $((l1 + 8 * r))) & 0x00fffffffffffe00))
		[ "$e" -gt 0 ] || fail "test premise: region $r has no L2" ||
			return 1
		[ $l2min -ge 0 ] && [ "$e" -ge $l2min ] || l2min=$e
		[ "$e" -le $l2max ] || l2max=$e
	done
	len=$(((l2max + 4096 - l2min) / 512))
	[ $len -eq $((120 * 8)) ] ||
		fail "test premise: L2 tables not contiguous ($l2min..$l2max)" ||
		return 1
	vlen=$(img_sectors "$img")
	DM_LEN=$vlen dm_create cf "$img 2 cache_size 256k" || return 1
	trap wdev_cleanup EXIT
	loop=$(cat "$FK_STATE/fk")
	sz=$(blockdev --getsz "$loop")
	s0=$((l2min / 512))
	fk_switch fk "0 $s0 flakey $loop 0 1 0
$s0 $len flakey $loop $s0 0 1 1 error_writes
$((s0 + len)) $((sz - s0 - len)) flakey $loop $((s0 + len)) 1 0" || return 1
	cmds=()
	for r in $(seq 0 99); do
		cmds+=(-c "write -P 0x3a $(((r << 21) + 8192)) 4k")
	done
	qemu-io -f raw -t none "${cmds[@]}" /dev/mapper/cf >qio.out 2>&1 &
	pid=$!
	rc=0
	bg_wait $pid 120 || rc=$?
	[ $rc -ne 2 ] || { unhang cf $pid; return 1; }
	n=$(grep -c '^wrote' qio.out)
	log "$n of 100 writes done, mode $(dm_mode cf), dirty $(dm_status_field cf 10)"
	[ "$(dm_mode cf)" = fail ] || fail "test premise: writeback did not fail" ||
		return 1
	# Reads of slices not in the cache
	dd if=/dev/mapper/cf of=rd.out bs=4k count=1 skip=$(((110 << 9) + 16)) \
		iflag=direct status=none 2>rd.err &
	pid=$!
	rc=0
	bg_wait $pid 60 || rc=$?
	[ $rc -ne 2 ] || { unhang cf $pid; return 1; }
	log "read: exit $rc $(cat rd.err)"
	fk_switch fk good || return 1
	dm_remove cf || return 1
	no_corruption "$img" || return 1
	cmds=()
	for r in $(seq 100 119); do
		cmds+=(-c "read -P 0x5c $(((r << 21) + 65536)) 4k")
	done
	qio -r -f qcow2 "${cmds[@]}" "$img" || return 1
	cd .. && rm -rf cf
}

# ---- 3. intermittent write faults, synchronous writes -------------------------

# 160 allocating 4 KiB writes, each followed by a flush (qemu-io
# directsync: "wrote" is printed only once the write and a flush
# completed), while the device flips between working and failing writes.
# Every write reported done must be in the image afterwards. The first 8
# go before the flipping starts: once a metadata write fails the device
# stays read-only, and a qemu-io slow to start under TCG met the first
# fault on its first write (0 acknowledged: no test at all). The rest
# start with writes failing: under KVM all 152 completed within the
# first 0.3 s of working writes (0 failed: no test either).
test_intermittent_sync_bdev() {
	local img k p cmds=() first=() out acked=0 failed=0 rd=() pid
	newdir is || return 1
	fk_bdev fk 160M || return 1
	img=$FK_IMG
	must qemu-img create -q -f qcow2 "$img" 256M || return 1
	wdev_create is "$img" || return 1
	for k in $(seq 0 159); do
		cmds+=(-c "write -P $((k % 250 + 1)) $((k * 1536 * 1024 + (k % 7) * 4096)) 4k")
	done
	first=("${cmds[@]:0:16}")	# -c and its command: 8 writes
	cmds=("${cmds[@]:16}")
	out=$(qemu-io -f raw -t directsync "${first[@]}" "$WDEV" 2>&1)
	echo "$out" >qio-first.out
	[ "$(grep -c '^wrote' qio-first.out)" -eq 8 ] ||
		fail "writes failed before any fault: $(tail -n 3 qio-first.out)" ||
		return 1
	fk_switch fk ewrite || return 1
	(
		while [ ! -e stop ]; do
			sleep 0.2
			fk_switch fk good
			sleep 0.3
			fk_switch fk ewrite
		done
	) >flip.out 2>&1 &
	pid=$!
	out=$(qemu-io -f raw -t directsync "${cmds[@]}" "$WDEV" 2>&1)
	touch stop
	bg_wait $pid 120 || return 1
	{ cat qio-first.out; echo "$out"; } >qio.out
	while read -r _ _ _ _ _ o; do
		k=$((o / (1536 * 1024)))
		p=$((k % 250 + 1))
		rd+=(-c "read -P $p $o 4k")
		acked=$((acked + 1))
	done < <(grep -E '^wrote 4096/4096 bytes at offset' qio.out)
	failed=$(grep -c 'write failed' qio.out)
	log "$acked writes acknowledged, $failed failed, mode $(dm_mode is)"
	[ $((acked + failed)) -eq 160 ] || fail "qemu-io: $(tail -n 3 qio.out)" ||
		return 1
	[ "$acked" -gt 0 ] && [ "$failed" -gt 0 ] ||
		fail "test premise: the fault did not hit mid-run" || return 1
	fk_switch fk good || return 1
	wdev_remove is || return 1
	no_corruption "$img" || return 1
	blockdev --flushbufs "$img"
	qio -r -f qcow2 "${rd[@]}" "$img" || fail "an acknowledged write is lost" ||
		return 1
	cd .. && rm -rf is
}

# ---- 4. read faults -------------------------------------------------------------

# Every read fails for a while, with the L2 table not cached (fresh
# activation): reads fail with EIO, health stays ok (an I/O error is not
# corruption), mode stays rw; once the device works again the same reads
# return the data (a failed table read is not remembered as zeros).
read_fault() {
	local kind=$1 img
	newdir rf || return 1
	if [ "$kind" = bdev ]; then
		fk_bdev fk 128M || return 1
		img=$FK_IMG
	else
		fk_fs fk 128M || return 1
		img=$FK_MNT/rf.qcow2
	fi
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	wdev_create rf "$img" || return 1
	write_a "$WDEV" || return 1
	wdev_remove rf || return 1
	wdev_create rf "$img" || return 1
	if [ "$kind" = file ]; then
		# Nothing left for ext4 to write while reads fail (a failed
		# journal write would abort it); no cached metadata to hide
		# the fault
		must sync -f "$FK_MNT/" || return 1
		echo 3 >/proc/sys/vm/drop_caches
	fi
	fk_switch fk eall || return 1
	must_fail 'Input/output error' dd if="$WDEV" of=/dev/null bs=64k \
		count=16 iflag=direct || return 1
	must_fail 'Input/output error' dd if="$WDEV" of=/dev/null bs=4k \
		count=1 skip=1000 iflag=direct || return 1
	fk_switch fk good || return 1
	[ "$(dm_status_field rf 8)" = ok ] ||
		fail "health $(dm_status_field rf 8) after read errors" || return 1
	[ "$(dm_mode rf)" = rw ] || fail "mode $(dm_mode rf) after read errors" ||
		return 1
	cmp -n $((8 << 20)) a.raw "$WDEV" || fail "A reads back wrong" ||
		return 1
	must dd if=/dev/urandom of="$WDEV" bs=64k count=4 seek=300 \
		oflag=direct,dsync conv=notrunc status=none || return 1
	wdev_remove rf || return 1
	if [ "$kind" = file ]; then
		must umount "$FK_MNT" && must mount -t ext4 -o noatime "$FK_DEV" "$FK_MNT" ||
			return 1
	fi
	img_check "$img" || return 1
	same_head a.raw "$img" || return 1
	cd .. && rm -rf rf
}

test_read_fault_bdev()	{ read_fault bdev; }
test_read_fault_file()	{ read_fault file; }

# ---- 5. dropped writes ------------------------------------------------------------

# drop_writes acknowledges writes that never land: nothing can notice it
# while it happens. The honest check is the one of a power cut: writes
# are dropped from some point of a workload until the device is removed
# (and the file system unmounted), so the disk holds exactly what had
# landed before that point. Then the image must not be corrupt, A (flushed
# before the workload began) must be intact, and the image must activate
# again and show A.
drop_fault() {
	local kind=$1 img pid rc
	newdir df || return 1
	if [ "$kind" = bdev ]; then
		fk_bdev fk 160M || return 1
		img=$FK_IMG
	else
		fk_fs fk 160M || return 1
		img=$FK_MNT/df.qcow2
	fi
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 64M ||
		return 1
	wdev_create df "$img" || return 1
	write_a "$WDEV" || return 1
	fio_flushing "$WDEV" 16M 40M 24M >fio.out 2>&1 &
	pid=$!
	sleep 2
	fk_switch fk drop || return 1
	rc=0
	bg_wait $pid 240 || rc=$?
	[ $rc -ne 2 ] || return 1
	log "fio: exit $rc (writes dropped silently)"
	wdev_remove df || return 1
	if [ "$kind" = bdev ]; then
		fk_switch fk good || return 1
	else
		fk_fs_recover fk || return 1
	fi
	no_corruption "$img" || return 1
	same_head a.raw "$img" || return 1
	# Activate again (writable): A, and a clean removal
	wdev_create df "$img" || return 1
	cmp -n $((8 << 20)) a.raw "$WDEV" || fail "A reads back wrong" ||
		return 1
	wdev_remove df || return 1
	no_corruption "$img" || return 1
	cd .. && rm -rf df
}

test_drop_bdev()	{ drop_fault bdev; }
test_drop_file()	{ drop_fault file; }

# ---- 6. a full file system ------------------------------------------------------

# The image in a 48 MiB ext4; allocating writes through the device fill it
# up. The write that finds no room fails with ENOSPC (what the file system
# says is passed on); the device stays read-write, reads and overwrites of
# allocated clusters work, flushes work, and the image is not corrupt.
test_enospc_fs() {
	local img out done_bytes rc mnt
	newdir nf || return 1
	must truncate -s 48M fs.disk || return 1
	must mkfs.ext4 -q -F fs.disk || return 1
	mnt=$PWD/mnt
	mkdir -p "$mnt"
	must mount -o loop fs.disk "$mnt" || return 1
	img=$mnt/nf.qcow2
	must qemu-img create -q -f qcow2 "$img" 256M || return 1
	wdev_create nf "$img" || return 1
	write_a "$WDEV" || return 1
	must dd if=/dev/urandom of=b.raw bs=1M count=64 status=none || return 1
	out=$(dd if=b.raw of="$WDEV" bs=64k seek=$((16 << 4)) oflag=direct \
		conv=notrunc 2>&1) && { fail "64 MiB fitted in 48 MiB"; return 1; }
	echo "$out" | grep -q 'No space left on device' ||
		fail "dd: $out" || return 1
	done_bytes=$(echo "$out" | sed -n 's/^\([0-9]*\) bytes.*/\1/p')
	log "written before ENOSPC: $done_bytes bytes; $(df -h "$mnt" | tail -n 1)"
	[ "$done_bytes" -ge $((1 << 20)) ] || fail "nothing was written" ||
		return 1
	[ "$(dm_mode nf)" = rw ] || fail "mode $(dm_mode nf) after ENOSPC" ||
		return 1
	# Still usable: overwrite part of A, flush, read everything back
	must dd if=/dev/urandom of=a.raw bs=64k count=8 seek=4 conv=notrunc \
		status=none || return 1
	must dd if=a.raw of="$WDEV" bs=64k count=8 skip=4 seek=4 oflag=direct \
		conv=notrunc status=none || return 1
	must fsync_path "$WDEV" || return 1
	cmp -n $((8 << 20)) a.raw "$WDEV" || fail "A reads back wrong" ||
		return 1
	cmp -n "$done_bytes" b.raw <(dd if="$WDEV" bs=64k skip=$((16 << 4)) \
		iflag=direct status=none) || fail "data before ENOSPC differs" ||
		return 1
	wdev_remove nf || return 1
	no_corruption "$img" || return 1
	same_head a.raw "$img" || return 1
	rc=0
	umount "$mnt" || rc=$?
	[ $rc -eq 0 ] || fail "umount" || return 1
	cd .. && rm -rf nf
}

# ---- 7. suspend, resume, reload, remove under I/O ----------------------------

# fio_verify DEV EXTRA...: random writes over 48 MiB (mixed sizes,
# 512-byte aligned), each block checked (crc32c) while writing
# (verify_backlog) and at the end.
fio_verify() {
	local dev=$1
	shift
	fio --filename="$dev" --direct=1 --ioengine=libaio --iodepth=8 \
		--bssplit=512/10:4k/30:16k/20:64k/30:256k/10 --blockalign=512 \
		--name=v --rw=randwrite --size=48M --randseed=4242 \
		--verify=crc32c --verify_fatal=1 "$@"
}

# cycles NAME TABLE PID: suspend/resume and reload the same table, one
# after the other, until PID exits; each step must finish within 60 s.
cycles() {
	local name=$1 tbl=$2 pid=$3 n=0
	while kill -0 "$pid" 2>/dev/null; do
		timeout 60 dmsetup suspend "$name" ||
			fail "suspend $n" || return 1
		sleep 0.2
		timeout 60 dmsetup resume "$name" || fail "resume $n" || return 1
		sleep 0.5
		timeout 60 dmsetup load "$name" --table "$tbl" ||
			fail "load $n" || return 1
		timeout 60 dmsetup resume "$name" || fail "reload $n" || return 1
		n=$((n + 1))
		sleep 0.5
	done
	log "$n suspend/resume + reload cycles"
	[ $n -ge 2 ] || fail "fio finished too early for the cycles"
}

suspend_case() {
	local kind=$1 img tbl pid rc opt=()
	newdir sr || return 1
	img=$PWD/sr.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 64M ||
		return 1
	if [ "$kind" = loop ]; then
		grow_for_loop "$img" || return 1
		opt=(loop)
	fi
	wdev_create sr "$img" "${opt[@]}" || return 1
	tbl=$(dmsetup table sr)
	fio_verify "$WDEV" --verify_backlog=128 >fio.out 2>&1 &
	pid=$!
	cycles sr "$tbl" $pid || { kill $pid; return 1; }
	rc=0
	bg_wait $pid 300 || rc=$?
	[ $rc -eq 0 ] || { tail -n 20 fio.out >&2; fail "fio: exit $rc"; return 1; }
	# Everything again, after the last cycle
	must fio_verify "$WDEV" --verify_only || return 1
	wdev_remove sr || return 1
	img_check "$img" || return 1
	wdev_create sr "$img" "${opt[@]}" || return 1
	must fio_verify "$WDEV" --verify_only || return 1
	wdev_remove sr || return 1
	cd .. && rm -rf sr
}

test_suspend_reload_file()	{ suspend_case file; }
test_suspend_reload_loop()	{ [ -n "$FAULT_FULL" ] || { log "skip: FAULT_FULL"; return 0; }; suspend_case loop; }

# wait_open NAME: until something holds the device open (fio started).
wait_open() {
	wait_open_by "$1" 1
}

# wait_open_by NAME N: until the device is open N times.
wait_open_by() {
	local n=300
	while [ "$(dmsetup info -c --noheadings -o open "$1")" -lt "$2" ]; do
		n=$((n - 1))
		[ $n -gt 0 ] || fail "$1 never opened" || return 1
		sleep 0.1
	done
}

# While the device is open and fio writes to it: "dmsetup remove" fails
# with EBUSY at once and changes nothing; a deferred removal happens at
# the last close; fio's verification passes; the image is clean and holds
# fio's data. The test holds the device open itself (fd 9) until fio is
# done: fio alone may finish before the removals are tried. Without udev
# the refused removal takes /dev/mapper/rb away, and fio opens the device
# again for its verify phase: fio gets a node of its own.
test_remove_busy() {
	local img pid rc out mm
	newdir rb || return 1
	img=$PWD/rb.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	wdev_create rb "$img" || return 1
	mm=$(dmsetup info -c --noheadings -o major,minor rb) ||
		fail "no device numbers for rb" || return 1
	must mknod rb.node b "${mm%%:*}" "${mm##*:}" || return 1
	exec 9<rb.node || fail "cannot open rb.node" || return 1
	fio_verify "$PWD/rb.node" --io_size=16M >fio.out 2>&1 &
	pid=$!
	# fio writes while the removals are tried
	wait_open_by rb 2 || return 1
	out=$(timeout 60 dmsetup remove rb 2>&1) && fail "removed while open" &&
		return 1
	echo "$out" | grep -q 'busy' || fail "remove: $out" || return 1
	must timeout 60 dmsetup remove --deferred rb || return 1
	dmsetup info rb >/dev/null 2>&1 || fail "removed before close" ||
		return 1
	rc=0
	bg_wait $pid 300 || rc=$?
	[ $rc -eq 0 ] || {
		grep -iE 'err=|verify|bad |crc|expected|received' fio.out |
			head -n 20 >&2
		tail -n 20 fio.out >&2
		fail "fio: exit $rc"
		return 1
	}
	dmsetup info rb >/dev/null 2>&1 ||
		fail "removed while still open" || return 1
	exec 9<&-
	sleep 1
	! dmsetup info rb >/dev/null 2>&1 ||
		fail "deferred removal did not happen" || return 1
	rm -f "$WDEV_STATE/rb"
	img_check "$img" || return 1
	wdev_create rb "$img" || return 1
	must fio_verify "$WDEV" --io_size=16M --verify_only || return 1
	wdev_remove rb || return 1
	cd .. && rm -rf rb
}

# "dmsetup remove --force" while fio writes: dmsetup swaps in an error
# table (the qcow2 table is suspended, written back and destroyed under
# I/O), fio then fails, and the device goes once fio closes it. The image
# must be clean: the suspend wrote everything back.
test_remove_force() {
	local img pid rc
	newdir rf || return 1
	img=$PWD/rf.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	wdev_create rfo "$img" || return 1
	# Ten passes, so that fio still runs when the table goes on a fast host
	fio_verify "$WDEV" --loops=10 >fio.out 2>&1 &
	pid=$!
	wait_open rfo || return 1
	sleep 1
	timeout 60 dmsetup remove --force rfo >rm.out 2>&1
	rc=$?
	[ $rc -ne 124 ] || fail "dmsetup remove --force hangs" || return 1
	log "remove --force: exit $rc: $(head -n 1 rm.out)"
	dmsetup table rfo 2>/dev/null | grep -qw qcow2 &&
		fail "qcow2 table still live after remove --force" && return 1
	rc=0
	bg_wait $pid 120 || rc=$?
	[ $rc -ne 2 ] || return 1
	[ $rc -ne 0 ] || fail "fio saw no error after the table went" ||
		return 1
	! dmsetup info rfo >/dev/null 2>&1 || must dmsetup remove rfo ||
		return 1
	rm -f "$WDEV_STATE/rfo"
	img_check "$img" || return 1
	cd .. && rm -rf rf
}

# ---- 8. an image on a device-mapper device ---------------------------------------

# The image on a dm-linear device (LVM's case): the table must load and
# the data read back. Minimal repro of a bug seen with flakey: the header
# probe reads 72 bytes (QCOW2_HEADER_PROBE_LEN) with one bio; a
# bio-based dm device maps bio_sectors() = 0 sectors of it and completes
# it without data, so the target sees zeros: "Not a qcow2 image (bad
# magic)". (A loop device happens to serve the partial sector.)
test_bdev_on_dm() {
	local loop sz rc
	newdir od || return 1
	must truncate -s 80M d.disk || return 1
	loop=$(losetup -f --show "$PWD/d.disk") || fail "losetup" || return 1
	sz=$(blockdev --getsz "$loop")
	must dmsetup create odl --table "0 $sz linear $loop 0" || return 1
	dmsetup mknodes odl
	must qemu-img create -q -f qcow2 /dev/mapper/odl 64M || return 1
	must qemu-io -f qcow2 -c "write -P 0x6b 1M 64k" /dev/mapper/odl ||
		return 1
	rc=0
	DM_LEN=$((64 << 11)) dm_create od /dev/mapper/odl || rc=1
	if [ $rc -eq 0 ]; then
		qio -r -f raw -c "read -P 0x6b 1M 64k" /dev/mapper/od || rc=1
		dm_remove od
	fi
	dmsetup remove odl
	losetup -d "$loop"
	[ $rc -eq 0 ] || fail "image on a dm device: $(last_dm_error)"
}
