# shellcheck shell=bash
# Crash consistency: every write dm-qcow2 sends to the device below is
# recorded by dm-log-writes, with the flushes, and the image is rebuilt as
# a power cut would leave it at many points of the log
# (tools/lw-replay.py): at each flush, half-way between two, and with a
# random subset of the writes since the last flush. Every rebuilt image
# must pass "qemu-img check" with no corruption (leaks are allowed), and
# every write acknowledged before the last completed flush must read back.
#
# Stack: image file (grown) -> loop -> log-writes "lw" (log on another
# loop device) -> dm-qcow2 (block-device backend). A workload step writes
# known data with O_DIRECT, flushes the dm-qcow2 device, then puts a mark
# in the log: a crash point past mark sK must show steps 1..K intact.
#
# Where the points are checked (QCOW2_CRASH_CHECK):
#   host (the default when the guest has $VM_OUT): the guest only records.
#     crash_points exports the log, the image before activation and the
#     expectations to $VM_OUT/crash/<case>, and tests/crash/check-host
#     rebuilds and checks every point on the host after the guest is
#     done, natively, about 20 times faster than under TCG. Only the
#     checks that need the kernel (the refusal of a dirty lazy-refcounts
#     image) stay in the guest.
#   guest: everything in the guest, as a case runs by hand.
# The full run (>= 500 points in all) is the default when checked on the
# host; QCOW2_CRASH_FULL=0 takes a small sample (fewer steps, fewer
# points). Each case logs its count.

# The helpers of t-write.sh (qio, newdir, hdr_byte, ...), not its cases
# shellcheck source=tests/vm/t-write.sh
. "$(dirname "${BASH_SOURCE[0]}")/t-write.sh"
for fn in $(declare -F | awk '{print $3}' | grep '^test_'); do
	unset -f "$fn"
done

REPLAY=$QCOW2_TOP/tools/lw-replay.py
CRASH_CHECK=${QCOW2_CRASH_CHECK:-host}
[ -n "${VM_OUT:-}" ] || [ -z "${VM_GUEST:-}" ] || CRASH_CHECK=guest
if [ "$CRASH_CHECK" = host ]; then
	CRASH_FULL=${QCOW2_CRASH_FULL:-1}
else
	CRASH_FULL=${QCOW2_CRASH_FULL:-0}
fi
CRASH_MNT=$SCRATCH/crash-mnt
# Counters of the check functions
CRASH_I=0 LAZY_DIRTY=0

# crash_max CI FULL: how many points a case checks.
crash_max() {
	if [ "$CRASH_FULL" = 1 ]; then echo "$2"; else echo "$1"; fi
}

# ---- the stack ------------------------------------------------------------

# EXIT trap of a case: take the stack down whatever state it is in.
crash_cleanup() {
	mountpoint -q "$CRASH_MNT" 2>/dev/null && umount "$CRASH_MNT"
	dmsetup remove q >/dev/null 2>&1
	dmsetup remove fk >/dev/null 2>&1
	dmsetup remove lw >/dev/null 2>&1
	[ -z "${LW_DLOOP:-}" ] || losetup -d "$LW_DLOOP" 2>/dev/null
	[ -z "${LW_LLOOP:-}" ] || losetup -d "$LW_LLOOP" 2>/dev/null
	LW_DLOOP="" LW_LLOOP=""
}

# lw_up IMG [flakey]: loop devices over IMG (given room to grow first)
# and over a fresh log file "log", log-writes "lw" over them and dm-qcow2
# "q" on /dev/mapper/lw; QDEV is /dev/mapper/q. With "flakey", a
# dm-flakey "fk" between lw and q (never down until fk_fault): what it
# fails never reaches the log.
lw_up() {
	local img=$1 len below=/dev/mapper/lw
	trap crash_cleanup EXIT
	modprobe dm-log-writes || fail "no dm-log-writes module" || return 1
	len=$(img_sectors "$img") || return 1
	grow_for_loop "$img" || return 1
	rm -f log && truncate -s 2G log || return 1
	LW_DLOOP=$(losetup -f --show "$img") || fail "losetup $img" || return 1
	LW_LLOOP=$(losetup -f --show log) || fail "losetup log" || return 1
	must dmsetup create lw --table \
		"0 $(blockdev --getsz "$LW_DLOOP") log-writes $LW_DLOOP $LW_LLOOP" ||
		return 1
	dmsetup mknodes lw
	if [ "${2:-}" = flakey ]; then
		must dmsetup create fk --table "$(fk_crash_table 0)" || return 1
		dmsetup mknodes fk
		below=/dev/mapper/fk
	fi
	DM_LEN=$len dm_create q "$below" || return 1
	QDEV=/dev/mapper/q
}

# fk_crash_table DOWN: the flakey table over lw: DOWN 0, never down; 1,
# always down with error_writes (every write and flush fails).
fk_crash_table() {
	local sz
	sz=$(blockdev --getsz /dev/mapper/lw)
	if [ "$1" = 0 ]; then
		echo "0 $sz flakey /dev/mapper/lw 0 1 0"
	else
		echo "0 $sz flakey /dev/mapper/lw 0 0 1 1 error_writes"
	fi
}

# fk_fault DOWN: swap fk's table live.
fk_fault() {
	timeout 60 dmsetup load fk --table "$(fk_crash_table "$1")" &&
		timeout 60 dmsetup suspend --nolockfs fk &&
		timeout 60 dmsetup resume fk || fail "cannot switch fk to $1"
}

# lw_down: remove dm-qcow2 (it writes back its metadata), then log-writes
# (it logs what is left and an end mark), and detach the loop devices.
lw_down() {
	mountpoint -q "$CRASH_MNT" && { must umount "$CRASH_MNT" || return 1; }
	dm_remove q || fail "cannot remove q" || return 1
	! dmsetup info fk >/dev/null 2>&1 || dm_remove fk ||
		fail "cannot remove fk" || return 1
	dm_remove lw || fail "cannot remove lw" || return 1
	losetup -d "$LW_DLOOP" && losetup -d "$LW_LLOOP" ||
		fail "losetup -d" || return 1
	LW_DLOOP="" LW_LLOOP=""
}

lw_mark() {
	must dmsetup message lw 0 mark "$1"
}

# ---- workload: steps of known data ------------------------------------------

# io_step K PATTERN "OFF LEN"...: step K writes PATTERN at each (OFF,
# LEN) at once (async, O_DIRECT), flushes, and marks "sK". What must then
# read back goes to "expect": "K PATTERN OFF LEN" lines. The rest of
# each cluster touched reads as FILL (a byte, "-" for no check). With
# STEP_BUFFERED set, the writes go through the device's page cache (the
# flush writes them back).
STEP_FILL=-
io_step() {
	local k=$1 p=$2 ol o l cs=${STEP_CS:-0} c0 c1 cmds=() direct=(-n)
	shift 2
	[ -z "${STEP_BUFFERED:-}" ] || direct=()
	for ol; do
		read -r o l <<<"$ol"
		cmds+=(-c "aio_write -P $p $o $l")
		echo "$k $p $o $l" >>expect
		[ "$STEP_FILL" != - ] || continue
		c0=$((o / cs * cs))
		c1=$(((o + l + cs - 1) / cs * cs))
		[ "$o" -eq $c0 ] || echo "$k $STEP_FILL $c0 $((o - c0))" >>expect
		[ $((o + l)) -eq $c1 ] ||
			echo "$k $STEP_FILL $((o + l)) $((c1 - o - l))" >>expect
	done
	qio "${direct[@]}" -f raw "${cmds[@]}" -c aio_flush -c flush "$QDEV" ||
		return 1
	lw_mark "s$k"
}

# fua_step K PATTERN "OFF LEN"...: step K writes PATTERN at each (OFF, LEN)
# at once with O_DSYNC through libaio (direct and asynchronous: FUA
# writes, and no flush after them), then marks "sK" (see io_step).
fua_step() {
	local k=$1 p=$2 ol o l jobs=()
	shift 2
	for ol; do
		read -r o l <<<"$ol"
		jobs+=(--name="w$o" --offset="$o" --size="$l")
		echo "$k $p $o $l" >>expect
	done
	must fio --filename="$QDEV" --rw=write --bs=4k --direct=1 \
		--ioengine=libaio --iodepth=4 --sync=1 \
		--buffer_pattern="$(printf '0x%02x' "$p")" --output=/dev/null \
		"${jobs[@]}" || return 1
	lw_mark "s$k"
}

# ---- checking crash points ---------------------------------------------------

# The step number a mark stands for: sK -> K, none -> 0, the end mark
# (after the last step) -> a large number.
mark_step() {
	case $1 in
	-) echo 0 ;;
	s[0-9]*) echo "${1#s}" ;;
	*) echo 999999 ;;
	esac
}

# check_no_corruption IMG: "qemu-img check" finds no corruption (exit 0,
# or 3: leaked clusters only).
check_no_corruption() {
	local rc=0
	qemu-img check "$1" >check.out 2>&1 || rc=$?
	[ $rc = 0 ] || [ $rc = 3 ] ||
		{ tail -n 20 check.out >&2; fail "qemu-img check: exit $rc"; return 1; }
	[ $rc = 0 ] || LEAKY=$((${LEAKY:-0} + 1))
}

# check_expect IMG K: the data of steps 1..K reads back from IMG.
check_expect() {
	local img=$1 k=$2 s p o l rd=()
	while read -r s p o l; do
		[ "$s" -le "$k" ] || break
		rd+=(-c "read -P $p $o $l")
	done <expect
	[ ${#rd[@]} -eq 0 ] || qio -r -f qcow2 "${rd[@]}" "$img"
}

# The default check of a point: no corruption, acknowledged data intact.
check_point() {
	check_no_corruption "$1" && check_expect "$1" "$(mark_step "$2")"
}

# crash_export BASE MAX CHECK: what crash_points needs, for
# tests/crash/check-host: BASE, ./log (sparse), the expectations of the
# case and "MAX CHECK", in $VM_OUT/crash/<case>.
crash_export() {
	local dir f case=${FUNCNAME[2]#test_}
	dir=$VM_OUT/crash/$case
	rm -rf "$dir" && mkdir -p "$dir" || fail "cannot make $dir" || return 1
	cp --sparse=always "$1" "$dir/base.qcow2" &&
		cp --sparse=always log "$dir/log" ||
		fail "cannot export the log" || return 1
	for f in expect fs-expect fs.py; do
		[ ! -e "$f" ] || cp "$f" "$dir/" || return 1
	done
	echo "$2 $3" >"$dir/check"
	log "log of $(python3 "$REPLAY" list log | grep -vc '^#') entries exported: up to $2 crash points are checked on the host (crash/$case)"
}

# crash_points BASE MAX CHECK: rebuild the image (BASE: the image before
# activation) at up to MAX crash points of ./log and run "CHECK IMG MARK"
# on each (MARK: the last mark before the point). Every point is checked;
# the first failing image, the log and the list of its entries are kept
# (copied to $VM_OUT/crash-<dir> in the VM) for replay on the host.
# With CRASH_CHECK=host, the guest exports the case instead.
crash_points() {
	local base=$1 max=$2 check=$3 n fl mode seed mark at=0 count=0 bad=0
	local keep
	if [ "$CRASH_CHECK" = host ] && [ -n "${VM_GUEST:-}" ]; then
		crash_export "$@"
		return
	fi
	LEAKY=0
	python3 "$REPLAY" plan log --max "$max" >points || fail "plan" || return 1
	[ -s points ] || fail "no crash points in the log" || return 1
	cp --sparse=always "$base" cur.qcow2 || return 1
	# The checks must not read the points: they come on fd 3
	while read -r -u 3 n fl mode seed mark; do
		# cur.qcow2 goes to the last flush, pt.qcow2 to the point
		must python3 "$REPLAY" point log cur.qcow2 pt.qcow2 --from "$at" \
			--to "$n" --unflushed "$mode" --seed "$seed" || return 1
		at=$fl
		count=$((count + 1))
		"$check" pt.qcow2 "$mark" && continue
		bad=$((bad + 1))
		echo "  crash point $n: last flush before it ends at $fl, unflushed writes: $mode (seed $seed), last mark $mark" >&2
		[ $bad = 1 ] || continue
		# Keep the first failure
		python3 "$REPLAY" list log >entries.txt
		mv pt.qcow2 failed.qcow2
		echo "$n $fl $mode $seed $mark" >failed-point
		[ -n "${VM_OUT:-}" ] || continue
		keep=$VM_OUT/crash-${PWD##*/}
		mkdir -p "$keep" && cp --sparse=always "$base" failed.qcow2 \
			failed-point log points entries.txt expect "$keep/" 2>/dev/null
		log "kept in $keep"
	done 3<points
	log "$count crash points checked, $bad failed ($LEAKY with leaked clusters); log of $(grep -vc '^#' entries.txt 2>/dev/null || python3 "$REPLAY" list log | grep -vc '^#') entries"
	[ $bad = 0 ] || fail "$bad of $count crash points failed"
}

# ---- cases ---------------------------------------------------------------------

# The prerequisite of the stack: the block-device backend on a device-
# mapper device (dm-linear over a loop device here). Device mapper
# completes a bio of less than one sector without any I/O, so metadata
# reads that are not whole logical blocks (the 72-byte header probe, an
# L1 table of 32 entries) must be rounded up by the target.
test_bdev_on_dm() {
	local img d
	newdir cr-dm || return 1
	img=$PWD/d.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 64M || return 1
	must qemu-io -f qcow2 -c "write -P 0x42 1M 64k" "$img" || return 1
	grow_for_loop "$img" || return 1
	d=$(losetup -f --show "$img") || fail "losetup" || return 1
	# shellcheck disable=SC2064 # $d is expanded now: it is local
	trap "dmsetup remove q >/dev/null 2>&1; dmsetup remove lin >/dev/null 2>&1; losetup -d $d" EXIT
	must dmsetup create lin --table "0 $(blockdev --getsz "$d") linear $d 0" ||
		return 1
	DM_LEN=$((64 << 11)) dm_create q /dev/mapper/lin ||
		fail "no dm-qcow2 on a dm device: $(last_dm_error)" || return 1
	qio -n -f raw -c "read -P 0x42 1M 64k" -c "write -P 0x43 8M 4k" \
		/dev/mapper/q || return 1
	dm_remove q && dm_remove lin || return 1
	img_check "$img" || return 1
	qio -r -f qcow2 -c "read -P 0x42 1M 64k" -c "read -P 0x43 8M 4k" "$img" ||
		return 1
	cd .. && rm -rf cr-dm
}

# Allocating random writes: 4 KiB clusters, 40 steps (CI: 20) of 3 writes each
# (512 B to 32 KiB, not cluster aligned) at random distinct places of
# 64 MiB; the rest of each touched cluster must read as zeros.
test_alloc_random() {
	local img k j slots=() w=()
	newdir cr-alloc || return 1
	img=$PWD/a.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 64M || return 1
	cp --sparse=always "$img" base.qcow2
	: >expect
	lw_up "$img" || return 1
	# 1024 slots of 64 KiB in random order: writes never overlap
	mapfile -t slots < <(shuf -i 0-1023 --random-source=<(yes))
	# CI: 20 steps; the full run 40
	for k in $(seq 1 $((CRASH_FULL != 0 ? 40 : 20))); do
		w=()
		for j in 0 1 2; do
			w+=("$((slots[k * 3 + j] * 65536 + (k * 7 + j) % 9 * 3584)) $(((k * 5 + j * 11) % 64 * 512 + 512))")
		done
		STEP_CS=4096 STEP_FILL=0 io_step "$k" $((k % 250 + 1)) "${w[@]}" ||
			return 1
	done
	lw_down || return 1
	crash_points "$PWD/base.qcow2" "$(crash_max 16 150)" check_point ||
		return 1
	img_check "$img" || return 1
	cd .. && rm -rf cr-alloc
}

# COW: 24 MiB written and snapshotted by qemu before activation, then 30
# steps of partial-cluster overwrites (64 KiB clusters): the new data and
# the old data around it in each cluster read back; the snapshot keeps
# the old data (checked every 8th point and at the last).
SNAP_EVERY=8
check_cow_point() {
	check_point "$1" "$2" || return 1
	[ $((CRASH_I++ % SNAP_EVERY)) = 0 ] || return 0
	cp --sparse=always "$1" snap.qcow2 &&
		must qemu-img snapshot -a s1 snap.qcow2 || return 1
	qio -r -f qcow2 -c "read -P 0x11 0 24M" snap.qcow2 ||
		fail "snapshot s1 data changed" || return 1
	rm -f snap.qcow2
}

test_cow_snapshot() {
	local img k w=()
	newdir cr-cow || return 1
	img=$PWD/c.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	must qemu-io -f qcow2 -c "write -P 0x11 0 24M" "$img" || return 1
	must qemu-img snapshot -c s1 "$img" || return 1
	cp --sparse=always "$img" base.qcow2
	: >expect
	lw_up "$img" || return 1
	for k in $(seq 1 30); do
		# Three clusters of the 384 shared ones, spread out
		w=("$(((k * 3) * 65536 + k * 1024)) $((k * 512 + 512))"
		   "$(((k * 3 + 100) * 65536 + 32768)) 4096"
		   "$(((k * 3 + 200) * 65536 - 2048)) 6144")
		STEP_CS=65536 STEP_FILL=0x11 io_step "$k" $((k % 250 + 1)) "${w[@]}" ||
			return 1
	done
	lw_down || return 1
	CRASH_I=0
	crash_points "$PWD/base.qcow2" "$(crash_max 12 120)" check_cow_point ||
		return 1
	CRASH_I=0
	check_cow_point "$img" end || return 1
	cd .. && rm -rf cr-cow
}

# Refcount blocks and refcount-table growth: 512-byte clusters, 2 GiB
# virtual; 32 steps of 20 scattered 16.5 KiB writes (as in
# test_scatter_rtgrow_c512) need new refcount blocks all along and a
# larger refcount table.
test_refcount_growth() {
	local img k j o w=() rtc stride=$(((2040 << 20) / 640 / 512 * 512))
	newdir cr-rc || return 1
	img=$PWD/r.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=512 "$img" 2G || return 1
	cp --sparse=always "$img" base.qcow2
	: >expect
	lw_up "$img" || return 1
	for k in $(seq 1 32); do
		w=()
		for j in $(seq 0 19); do
			# Steps interleave over the whole device
			o=$(((j * 32 + k - 1) * stride + k % 7 * 512))
			w+=("$o 16896")
		done
		STEP_CS=512 io_step "$k" $((k % 250 + 1)) "${w[@]}" || return 1
	done
	lw_down || return 1
	rtc=$(od -An -tu4 --endian=big -j 56 -N 4 "$img" | tr -d ' ')
	log "refcount table: $rtc clusters"
	[ "$rtc" -gt 1 ] || fail "test premise: refcount table did not grow" ||
		return 1
	crash_points "$PWD/base.qcow2" "$(crash_max 16 150)" check_point ||
		return 1
	img_check "$img" || return 1
	cd .. && rm -rf cr-rc
}

# L2-table allocation: 1 TiB virtual, 64 KiB clusters (an L2 table maps
# 512 MiB); 24 steps of 4 writes, each under an L2 table of its own.
test_l2_alloc() {
	local img k j w=()
	newdir cr-l2 || return 1
	img=$PWD/l.qcow2
	must qemu-img create -q -f qcow2 "$img" 1T || return 1
	cp --sparse=always "$img" base.qcow2
	: >expect
	lw_up "$img" || return 1
	for k in $(seq 1 24); do
		w=()
		for j in 0 1 2 3; do
			w+=("$((((j * 24 + k) * 21 % 2000) * (512 << 20) + k * 4096 + j * 512)) 4096")
		done
		STEP_CS=65536 STEP_FILL=0 io_step "$k" $((k % 250 + 1)) "${w[@]}" ||
			return 1
	done
	lw_down || return 1
	crash_points "$PWD/base.qcow2" "$(crash_max 12 100)" check_point ||
		return 1
	img_check "$img" || return 1
	cd .. && rm -rf cr-l2
}

# Page-cache writes into new clusters (64 KiB): write-back sends the
# pages of a cluster together, the first allocates it and the others are
# gathered into its write, with zeros between them (t-write.sh
# gather_case). 12 steps (CI: 8), each in two clusters of its own: pages
# with gaps in one, a run inside the other. A point past mark sK must
# show steps 1..K, the gaps and the edges of the clusters as zeros.
test_gathered() {
	local img k b z
	newdir cr-ga || return 1
	img=$PWD/g.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	cp --sparse=always "$img" base.qcow2
	: >expect
	lw_up "$img" || return 1
	for k in $(seq 1 $((CRASH_FULL != 0 ? 12 : 8))); do
		b=$((k << 20))
		STEP_BUFFERED=1 io_step "$k" $((k + 1)) "$b 4096" \
			"$((b + 12288)) 8192" "$((b + 40960)) 4096" \
			"$((b + 69632)) 57344" || return 1
		for z in "4096 8192" "20480 20480" "45056 20480" "65536 4096" \
			"126976 4096"; do
			echo "$k 0 $((b + ${z% *})) ${z#* }" >>expect
		done
	done
	lw_down || return 1
	crash_points "$PWD/base.qcow2" "$(crash_max 12 60)" check_point ||
		return 1
	img_check "$img" || return 1
	cd .. && rm -rf cr-ga
}

# FUA writes with no flush after them (what a journal commit is): 20
# steps (CI: 10). Each writes over clusters allocated and flushed
# earlier (in place, served without a metadata write-back as none is
# pending), and alternately over clusters a plain write just allocated
# (in place, but their mapping is not durable yet: it must be written
# back first) or over new ones (allocating: the metadata goes first). A
# point past mark sK must show steps 1..K: a FUA write is durable once
# acknowledged, with the mapping that leads to it. (Steps of the first
# kind allocate nothing with FUA, so no later write-back in the step
# would hide a mapping left behind.)
test_fua_writes() {
	local img k o
	newdir cr-fua || return 1
	img=$PWD/f.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 64M || return 1
	cp --sparse=always "$img" base.qcow2
	: >expect
	lw_up "$img" || return 1
	# Step 1 allocates what later steps overwrite: no expectation of its own
	qio -n -f raw -c "write -P 1 0 8M" -c flush "$QDEV" || return 1
	lw_mark s1
	for k in $(seq 2 $((CRASH_FULL != 0 ? 21 : 11))); do
		o=$(((k + 8) << 20))
		if [ $((k % 2)) = 0 ]; then
			# Not qemu-io: it flushes the device when it closes it
			must fio --name=plain --filename="$QDEV" --rw=write \
				--bs=16k --offset="$o" --size=16k --direct=1 \
				--ioengine=libaio --buffer_pattern=$((k + 100)) \
				--output=/dev/null || return 1
		else
			o=$((o + 524288))
		fi
		fua_step "$k" $((k + 40)) "$((k * 393216)) $((k % 4 * 4096 + 4096))" \
			"$o $((k % 3 * 4096 + 8192))" || return 1
	done
	lw_down || return 1
	crash_points "$PWD/base.qcow2" "$(crash_max 16 100)" check_point ||
		return 1
	img_check "$img" || return 1
	cd .. && rm -rf cr-fua
}

# Subclusters: an extended-L2 image (64 KiB clusters, 2 KiB subclusters)
# partly written by qemu (allocated, zero and unallocated subclusters),
# then 24 steps of sub-cluster writes, two per cluster per step, into
# clusters qemu left partly allocated and into new ones: the partial
# allocations and bitmap changes must be crash-safe.
test_subclusters() {
	local img k w=()
	newdir cr-sc || return 1
	img=$PWD/s.qcow2
	must qemu-img create -q -f qcow2 -o extended_l2=on "$img" 64M ||
		return 1
	# Even clusters: the first half allocated, a zero run after it
	for k in $(seq 0 2 60); do
		w+=(-c "write -P 0x11 $((k * 65536)) 32k"
		    -c "write -z $((k * 65536 + 32768)) 8k")
	done
	qio -f qcow2 "${w[@]}" "$img" || return 1
	cp --sparse=always "$img" base.qcow2
	: >expect
	lw_up "$img" || return 1
	for k in $(seq 1 24); do
		# Cluster k + 1: either qemu's (even) or a new one (odd)
		w=("$(((k + 1) * 65536 + 30720 + k % 3 * 512)) $((k % 4 * 1024 + 2560))"
		   "$(((k + 1) * 65536 + 49152 + k * 512)) 1536"
		   "$(((k + 40) * 65536 + k * 1024)) 4096")
		io_step "$k" $((k % 250 + 1)) "${w[@]}" || return 1
	done
	lw_down || return 1
	crash_points "$PWD/base.qcow2" "$(crash_max 12 100)" check_point ||
		return 1
	img_check "$img" || return 1
	cd .. && rm -rf cr-sc
}

# Growing past the L1 table's clusters moves the L1 table (at resume):
# 512-byte clusters, 1 MiB grown to 8 MiB between steps 6 and 7; steps
# write below and above the old end.
test_l1_move() {
	local img k w=()
	newdir cr-l1 || return 1
	img=$PWD/m.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=512 "$img" 1M ||
		return 1
	cp --sparse=always "$img" base.qcow2
	: >expect
	lw_up "$img" || return 1
	for k in $(seq 1 6); do
		io_step "$k" $((k % 250 + 1)) "$((k * 130560)) 1536" || return 1
	done
	must dmsetup suspend q &&
		must dmsetup load q --table "0 $((8 << 11)) qcow2 /dev/mapper/lw 1 grow" &&
		must dmsetup resume q || return 1
	for k in $(seq 7 18); do
		w=("$((k * 430080 + 512)) 2048" "$((k * 4096)) 512")
		io_step "$k" $((k % 250 + 1)) "${w[@]}" || return 1
	done
	lw_down || return 1
	[ "$(img_sectors "$img")" = $((8 << 11)) ] ||
		fail "test premise: the image did not grow" || return 1
	crash_points "$PWD/base.qcow2" "$(crash_max 12 100)" check_point ||
		return 1
	img_check "$img" || return 1
	cd .. && rm -rf cr-l1
}

# Lazy refcounts: the same kind of workload on a lazy_refcounts=on image.
# Past the first mark (an acknowledged write) the dirty bit is set until
# the clean removal, past the mark "removal", clears it (the image must
# then pass the usual checks); a dirty image is refused for writing with
# a message naming "qemu-img check -r all", after which it is clean and
# holds the acknowledged data.
# An image not (yet) dirty gets the usual checks. The refusal needs the
# kernel: checked in the guest only (on a few points when the rest are
# checked on the host).
check_lazy_point() {
	local img=$PWD/$1 mark=$2 dirty len
	dirty=$(($(hdr_byte "$img" $DIRTY_BYTE) & DIRTY_BIT))
	[ "$mark" = - ] || [ "$mark" = removal ] || [ $dirty = 1 ] ||
		fail "dirty bit clear after an acknowledged write" || return 1
	if [ $dirty = 0 ]; then
		check_point "$1" "$mark"
		return
	fi
	LAZY_DIRTY=$((LAZY_DIRTY + 1))
	[ -z "${VM_GUEST:-}" ] || check_lazy_refused "$img" || return 1
	must qemu-img check -r all "$img" || return 1
	must qemu-img check "$img" || fail "not clean after check -r all" ||
		return 1
	[ $(($(hdr_byte "$img" $DIRTY_BYTE) & DIRTY_BIT)) = 0 ] ||
		fail "dirty bit set after check -r all" || return 1
	check_expect "$img" "$(mark_step "$mark")"
}

# check_lazy_refused IMG: dm-qcow2 refuses the dirty image for writing
# and names the repair.
check_lazy_refused() {
	local img=$1 len
	len=$(img_sectors "$img") || return 1
	if dmsetup create lzp --table "0 $len qcow2 $img" 2>/dev/null; then
		dm_remove lzp
		fail "dirty image accepted for writing"
		return 1
	fi
	dmesg | tail -n 5 | grep -qF "qemu-img check -r all" ||
		fail "refused with: $(last_dm_error)"
}

test_lazy_refcounts() {
	local img k j w=()
	newdir cr-lazy || return 1
	img=$PWD/z.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=4k,lazy_refcounts=on \
		"$img" 64M || return 1
	cp --sparse=always "$img" base.qcow2
	: >expect
	lw_up "$img" || return 1
	for k in $(seq 1 24); do
		w=()
		for j in 0 1 2; do
			w+=("$(((k * 3 + j) * 37 % 1000 * 65536 + k * 1536)) $((k % 5 * 4096 + 1536))")
		done
		STEP_CS=4096 STEP_FILL=0 io_step "$k" $((k % 250 + 1)) "${w[@]}" ||
			return 1
	done
	lw_mark removal || return 1
	lw_down || return 1
	[ $(($(hdr_byte "$img" $DIRTY_BYTE) & DIRTY_BIT)) = 0 ] ||
		fail "dirty bit set after a clean removal" || return 1
	LAZY_DIRTY=0
	# The refusal is checked here, in the guest, on a few points at least
	if [ "$CRASH_CHECK" = host ]; then
		CRASH_CHECK=guest crash_points "$PWD/base.qcow2" 4 \
			check_lazy_point || return 1
		log "$LAZY_DIRTY dirty images refused, repaired and checked in the guest"
		[ "$LAZY_DIRTY" -gt 0 ] ||
			fail "no crash point had the dirty bit" || return 1
	fi
	crash_points "$PWD/base.qcow2" "$(crash_max 12 100)" check_lazy_point ||
		return 1
	[ "$CRASH_CHECK" = host ] ||
		log "$LAZY_DIRTY dirty images refused, repaired and checked"
	[ "$CRASH_CHECK" = host ] || [ "$LAZY_DIRTY" -gt 0 ] ||
		fail "no crash point had the dirty bit" || return 1
	img_check "$img" || return 1
	cd .. && rm -rf cr-lazy
}

# A window of failing writes and flushes below the target (flakey
# between log-writes and dm-qcow2: what fails never reaches the log),
# opened while steps of allocating writes and flushes run: 4 KiB
# clusters, three scattered writes a step. Steps before the window are
# acknowledged; the first that meets it fails, and so must every step
# after the window closes (fail mode: no flush passes again, no metadata
# is written). Every crash point of the log has no corruption and the
# data of every step acknowledged before it.
try_step() {
	local k=$1 p=$2 ol o l cmds=()
	shift 2
	for ol; do
		read -r o l <<<"$ol"
		cmds+=(-c "aio_write -P $p $o $l")
	done
	qemu-io -n -f raw "${cmds[@]}" -c aio_flush -c flush "$QDEV" \
		>step.out 2>&1 && ! grep -qiE 'fail|error' step.out || return 1
	for ol; do
		echo "$k $p $ol" >>expect
	done
	lw_mark "s$k"
}

fault_writes() {
	local j
	w=()
	for j in 0 1 2; do
		w+=("$(((k * 3 + j) * 53 % 1024 * 65536 + k % 11 * 3584)) $((k % 7 * 512 + 3584))")
	done
}

test_fault_window() {
	local img k w acked=0 failed=0 after=0 pid
	newdir cr-fw || return 1
	img=$PWD/w.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 64M || return 1
	cp --sparse=always "$img" base.qcow2
	: >expect
	lw_up "$img" flakey || return 1
	for k in $(seq 1 6); do
		fault_writes
		try_step "$k" $((k + 1)) "${w[@]}" ||
			fail "step $k failed before the fault" || return 1
		acked=$k
	done
	# The window opens while the steps run, and closes once one failed
	( sleep 1; fk_fault 1; while [ ! -e failed ]; do sleep 0.2; done
	  sleep 0.5; fk_fault 0; touch closed ) >fk.out 2>&1 &
	pid=$!
	for k in $(seq 7 200); do
		fault_writes
		if try_step "$k" $((k % 250 + 1)) "${w[@]}"; then
			[ ! -e failed ] || fail "step $k acknowledged after a failed one" ||
				return 1
			acked=$k
		else
			touch failed
			failed=$((failed + 1))
			[ ! -e closed ] || after=$((after + 1))
			[ "$after" -lt 3 ] || break
		fi
	done
	wait $pid
	log "$acked steps acknowledged, $failed failed ($after after the window closed), mode $(dm_status_field q 1)"
	[ -e failed ] && [ "$after" -eq 3 ] ||
		fail "test premise: the window did not meet a step" || return 1
	[ "$(dm_status_field q 1)" = fail ] ||
		fail "mode $(dm_status_field q 1) after the window" || return 1
	lw_mark removal || return 1
	lw_down || return 1
	crash_points "$PWD/base.qcow2" "$(crash_max 12 80)" check_point ||
		return 1
	check_no_corruption "$img" || return 1
	cd .. && rm -rf cr-fw
}

# ext4 on top, fsync-heavy: files of 1 to 48 KiB, each written, fsync'ed
# with its directory, then a mark; every 4th step also appends a line to
# one growing file. At each point the image has no corruption, e2fsck
# (after replaying the journal) finds the file system clean, and every
# file fsync'ed before the last mark is intact (the growing file starts
# with every line appended before it).
FS_STEPS=48
check_fs_point() {
	local k rc
	k=$(mark_step "$2")
	check_no_corruption "$1" || return 1
	must qemu-img convert -O raw "$1" fs.raw || return 1
	# Replaying the journal may return 1 ("changes made")
	e2fsck -y -E journal_only fs.raw >e2fsck.out 2>&1
	rc=$?
	[ $rc -le 1 ] || { cat e2fsck.out >&2; fail "journal replay: $rc"; } ||
		return 1
	must e2fsck -fn fs.raw || fail "e2fsck: file system not clean" ||
		return 1
	# The files are read by debugfs (no mount: this runs on the host too)
	rm -rf fs-dump && mkdir fs-dump || return 1
	awk '{print "dump " $3 " fs-dump/" $3}' fs-expect | sort -u >fs-dump.cmd
	debugfs -f fs-dump.cmd fs.raw >/dev/null 2>&1
	python3 "$FS_PY" check fs-dump "$k" <fs-expect >fs-check.out 2>&1
	rc=$?
	rm -rf fs.raw fs-dump
	[ $rc = 0 ] || { cat fs-check.out >&2; fail "fsync'ed files differ"; }
}

test_fs_ext4_fsync() {
	local img
	newdir cr-fs || return 1
	img=$PWD/f.qcow2
	FS_PY=$PWD/fs.py
	mkdir -p "$CRASH_MNT"
	cat >"$FS_PY" <<'EOF'
import hashlib, os, random, subprocess, sys
mode, mnt = sys.argv[1], sys.argv[2]
if mode == "write":
    # One file a step, fsync'ed with its directory, then a mark
    rng = random.Random(7)
    dfd = os.open(mnt, os.O_RDONLY)
    for k in range(1, int(sys.argv[3]) + 1):
        name = "f%04d" % k
        data = rng.randbytes(rng.randrange(1, 49) * 1024 - rng.randrange(512))
        fd = os.open(os.path.join(mnt, name), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        if k % 4 == 0:
            line = "step_%d_%s" % (k, "x" * rng.randrange(10, 200))
            fd = os.open(os.path.join(mnt, "appendlog"),
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(fd, line.encode() + b"\n")
            os.fsync(fd)
            os.close(fd)
            print("%d append appendlog %s" % (k, line))
        os.fsync(dfd)
        subprocess.run(["dmsetup", "message", "lw", "0", "mark", "s%d" % k],
                       check=True)
        print("%d file %s %s" % (k, name, hashlib.sha256(data).hexdigest()),
              flush=True)
    sys.exit(0)
# check: what steps 1..K fsync'ed is there
k = int(sys.argv[3])
bad = 0
app = b""
for line in sys.stdin:
    s, kind, name, val = line.split()
    if int(s) > k:
        break
    p = os.path.join(mnt, name)
    if kind == "file":
        try:
            got = hashlib.sha256(open(p, "rb").read()).hexdigest()
        except OSError as e:
            got = str(e)
        if got != val:
            print("%s: %s, want %s" % (name, got, val))
            bad += 1
    else:
        app += val.encode() + b"\n"
if app:
    got = open(os.path.join(mnt, "appendlog"), "rb").read()
    if not got.startswith(app):
        print("appendlog: %d bytes, lacks acknowledged lines" % len(got))
        bad += 1
sys.exit(1 if bad else 0)
EOF
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 256M ||
		return 1
	# The file system is made before recording (no lazy init left to run)
	wdev_create mk "$img" || return 1
	must mkfs.ext4 -q -E lazy_itable_init=0,lazy_journal_init=0 "$WDEV" ||
		return 1
	wdev_remove mk || return 1
	cp --sparse=always "$img" base.qcow2
	lw_up "$img" || return 1
	must mount "$QDEV" "$CRASH_MNT" || return 1
	python3 "$FS_PY" write "$CRASH_MNT" "$FS_STEPS" >fs-expect ||
		fail "fs workload" || return 1
	log "$(grep -c . fs-expect) files and appends fsync'ed"
	lw_down || return 1
	crash_points "$PWD/base.qcow2" "$(crash_max 6 80)" check_fs_point ||
		return 1
	img_check "$img" || return 1
	cd .. && rm -rf cr-fs
}
