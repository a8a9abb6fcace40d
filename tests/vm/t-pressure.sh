# shellcheck shell=bash
# Memory pressure: writes through the device complete while memory is
# short and the memory can only be freed by writing through the device.
# Needs a small guest and two raw disks besides the scratch disk, as
# "scripts/run-tests t-pressure.sh" gives it (512 MiB, /dev/vdb and
# /dev/vdc of 2 GiB; not part of the CI suite, see tests/vm/suite.sh):
#
#   swap_qcow2_bdev  swap on dm-qcow2 over an empty image on /dev/vdb
#                    (every page swapped out allocates clusters), while
#                    a process touching 1.7 times the RAM runs twice over
#                    its memory: it completes with its data intact, no
#                    swap write error, no hung task (hung_task_panic), and
#                    the image checks clean
#   swap_linear      the same on dm-linear over /dev/vdb: the baseline
#   fs_file_swap     ext4 on dm-qcow2 over an empty image file takes
#                    PRESSURE_FS_MIB of buffered writes while that process
#                    pushes memory out to plain swap on /dev/vdc: no I/O
#                    error, the data reads back after the page cache is
#                    dropped, fsck and qemu-img check clean
#
# The cases log their time: the report's ratio is qcow2 against linear.
# PRESSURE_HOG_PCT (default 170): the process's size in percent of RAM.
# PRESSURE_FS_MIB (default 384), PRESSURE_TIMEOUT (seconds the process
# may take, default 900: about ten times a run alone under TCG).

# shellcheck source=tests/vm/t-write.sh
. "$(dirname "${BASH_SOURCE[0]}")/t-write.sh"
for fn in $(declare -F | awk '{print $3}' | grep '^test_'); do
	unset -f "$fn"
done

PRESSURE_HOG_PCT=${PRESSURE_HOG_PCT:-${QCOW2_PRESSURE_HOG_PCT:-170}}
PRESSURE_FS_MIB=${PRESSURE_FS_MIB:-${QCOW2_PRESSURE_FS_MIB:-384}}
PRESSURE_TIMEOUT=${PRESSURE_TIMEOUT:-${QCOW2_PRESSURE_TIMEOUT:-900}}
PRESSURE_SWAP=/run/t-pressure-swap

# hog MIB: allocate MIB MiB, each MiB filled with its own byte, then go
# over all of it twice, checking and rewriting it: pages go out to swap
# and come back. Fails on any wrong byte.
hog() {
	python3 - "$1" <<'EOF'
import sys
mib = int(sys.argv[1])
blocks = [bytearray([i % 251]) * (1 << 20) for i in range(mib)]
for rnd in range(2):
    for i, b in enumerate(blocks):
        want = (i + rnd) % 251
        if b.count(want) != len(b):
            sys.exit("block %d: wrong data in round %d" % (i, rnd))
        b[:] = bytearray([(i + rnd + 1) % 251]) * len(b)
print("hog: %d MiB checked twice" % mib)
EOF
}

# hog_bounded MIB: hog, which must end within PRESSURE_TIMEOUT seconds;
# if not, the blocked tasks go to the kernel log (sysrq w) and it fails.
hog_bounded() {
	local pid
	hog "$1" >hog.out 2>&1 &
	pid=$!
	if ! bg_wait_timeout $pid "$PRESSURE_TIMEOUT"; then
		echo w >/proc/sysrq-trigger
		fail "the process did not end within $PRESSURE_TIMEOUT s (blocked tasks in the kernel log)"
		return 1
	fi
	wait $pid || { cat hog.out >&2; fail "the process failed"; return 1; }
}

# bg_wait_timeout PID SECONDS: true once PID has ended, false after SECONDS.
bg_wait_timeout() {
	local n=$(($2 * 2))
	while kill -0 "$1" 2>/dev/null; do
		n=$((n - 1))
		[ $n -gt 0 ] || return 1
		sleep 0.5
	done
}

# hog_mib: PRESSURE_HOG_PCT of the guest's RAM, in MiB.
hog_mib() {
	awk -v p="$PRESSURE_HOG_PCT" '/^MemTotal:/ {print int($2 / 1024 * p / 100)}' \
		/proc/meminfo
}

# Pages swapped out since boot.
pswpout() {
	awk '$1 == "pswpout" {print $2}' /proc/vmstat
}

need_disk() {
	[ -b "$1" ] || fail "no $1: run with two extra disks (scripts/run-tests t-pressure.sh)"
}

# A hang must not pass: hung_task_panic stops the guest, and the run
# misses its results.
hang_guard() {
	sysctl -qw kernel.hung_task_timeout_secs=120 kernel.hung_task_panic=1 ||
		fail "no hung task detector"
}

swap_on() {
	must mkswap -q "$1" || return 1
	swapon -p 10 "$1" || fail "swapon $1" || return 1
	echo "$1" >>"$PRESSURE_SWAP"
}

pressure_cleanup() {
	local s
	if [ -e "$PRESSURE_SWAP" ]; then
		while read -r s; do
			swapoff "$s" 2>/dev/null
		done <"$PRESSURE_SWAP"
		rm -f "$PRESSURE_SWAP"
	fi
	sysctl -qw kernel.hung_task_panic=0
	wdev_cleanup
	dmsetup remove plin 2>/dev/null
}

# No error on the swap or block device since the case began.
no_io_errors() {
	if dmesg | sed -n "/$1/,\$p" | grep -E 'Write-error on swap|Read-error on swap|I/O error|blk_update_request|Buffer I/O error|EXT4-fs error|device-mapper: qcow2: .*failed' |
		head -n 5 | grep .; then
		fail "I/O errors in the kernel log"
		return 1
	fi
}

# swap_run DEV: swap on DEV, the process through it, swap off.
swap_run() {
	local dev=$1 mark="t-pressure $RANDOM$RANDOM" start=$SECONDS mib out
	echo "$mark" >/dev/kmsg
	swap_on "$dev" || return 1
	mib=$(hog_mib)
	out=$(pswpout)
	hog_bounded "$mib" || return 1
	log "$(cat hog.out), $((SECONDS - start)) s, $((($(pswpout) - out) / 256)) MiB swapped out"
	swapoff "$dev" || fail "swapoff $dev" || return 1
	sed -i "\|^$dev\$|d" "$PRESSURE_SWAP"
	no_io_errors "$mark"
}

test_swap_qcow2_bdev() {
	need_disk /dev/vdb || return 1
	newdir sq || return 1
	trap pressure_cleanup EXIT
	hang_guard || return 1
	must qemu-img create -q -f qcow2 -o cluster_size=64k /dev/vdb 1536M ||
		return 1
	wdev_create sq /dev/vdb || return 1
	swap_run "$WDEV" || return 1
	wdev_remove sq || return 1
	blockdev --flushbufs /dev/vdb
	img_check /dev/vdb || return 1
	log "image: $(qemu-img check /dev/vdb | grep -E 'allocated')"
	cd .. && rm -rf sq
}

test_swap_linear() {
	need_disk /dev/vdb || return 1
	newdir sl || return 1
	trap pressure_cleanup EXIT
	hang_guard || return 1
	must dmsetup create plin --table "0 $((1536 << 11)) linear /dev/vdb 0" ||
		return 1
	dmsetup mknodes plin
	swap_run /dev/mapper/plin || return 1
	must dmsetup remove plin || return 1
	cd .. && rm -rf sl
}

test_fs_file_swap() {
	local mark="t-pressure $RANDOM$RANDOM" start=$SECONDS mib pid sum
	need_disk /dev/vdc || return 1
	newdir fs || return 1
	trap pressure_cleanup EXIT
	hang_guard || return 1
	echo "$mark" >/dev/kmsg
	must qemu-img create -q -f qcow2 fs.qcow2 2G || return 1
	wdev_create fs "$PWD/fs.qcow2" || return 1
	must mkfs.ext4 -q -E nodiscard "$WDEV" || return 1
	mkdir -p "$SCRATCH/mnt" && must mount "$WDEV" "$SCRATCH/mnt" || return 1
	swap_on /dev/vdc || return 1
	mib=$(hog_mib)
	hog "$mib" >hog.out 2>&1 &
	pid=$!
	dd if=/dev/urandom bs=1M count="$PRESSURE_FS_MIB" status=none |
		tee "$SCRATCH/mnt/data" | md5sum >sum.w
	must sync || return 1
	wait $pid || { cat hog.out >&2; fail "the process failed"; return 1; }
	log "$(cat hog.out), $PRESSURE_FS_MIB MiB written, $((SECONDS - start)) s"
	echo 3 >/proc/sys/vm/drop_caches
	sum=$(md5sum <"$SCRATCH/mnt/data")
	[ "$sum" = "$(cat sum.w)" ] || fail "the file reads back wrong" || return 1
	must umount "$SCRATCH/mnt" || return 1
	must e2fsck -fn "$WDEV" || return 1
	swapoff /dev/vdc
	rm -f "$PRESSURE_SWAP"
	wdev_remove fs || return 1
	img_check fs.qcow2 || return 1
	no_io_errors "$mark" || return 1
	cd .. && rm -rf fs
}
