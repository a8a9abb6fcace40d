#!/bin/bash
# Benchmark, run inside the guest by scripts/bench (one boot): dm-qcow2
# (file backend, and on a loop device over the same image), loop with
# direct I/O on a raw file, and qemu-nbd on the same qcow2 image, on a
# scratch virtio disk formatted ext4.
#
# Usage: bench-guest.sh [--quick] [--runtime SEC] [--only REGEX]
#                       [--rounds N] [--profile] [--states REGEX]
#   --quick        256 MiB images, 2 s runs, four workloads (a smoke run)
#   --runtime SEC  seconds per fio/dd run (default 5, 2 with --quick)
#   --only REGEX   run only the workloads whose name matches
#   --rounds N     run every workload N times on each device (default 1);
#                  each workload runs on every device in turn, the order
#                  rotating by workload and round, and the report takes
#                  the median of the rounds
#   --states REGEX which of the states prealloc, empty and big (the 1 TiB
#                  and 1 GiB images) to run (default: all)
#   --profile      sample every CPU with perf during each run (perf record
#                  -a -g, the kernel's symbols) and leave the report of
#                  where system time went in $VM_OUT/raw/*.perf.txt
#
# Each run leaves its output and a .meta line in $VM_OUT/raw/ (parsed by
# tests/vm/bench-report.py, which makes the tables and the chart on the
# host). Image states:
#   empty     a new image for every write workload: writes allocate
#             (qcow2 created empty; raw: a sparse file)
#   prealloc  every cluster allocated and holding data (raw: fallocate,
#             then filled; qcow2: converted from that raw file)
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tests/vm/lib.sh
. "$here/lib.sh"

# The workloads of --quick (unless --only says otherwise)
QUICK_ONLY='^(rr4k-q32|rw4k-q32|sw1m|dd-w4k-direct)$'
quick=
runtime=
only=.
ROUNDS=1
PROFILE=
STATES=.
while [ $# -gt 0 ]; do
	case $1 in
	--quick) quick=1; [ "$only" != . ] || only=$QUICK_ONLY; shift ;;
	--runtime) runtime=$2; shift 2 ;;
	--only) only=$2; shift 2 ;;
	--rounds) ROUNDS=$2; shift 2 ;;
	--profile) PROFILE=1; shift ;;
	--states) STATES=$2; shift 2 ;;
	*) echo "usage: $0 [--quick] [--runtime SEC] [--only REGEX] [--rounds N] [--profile] [--states REGEX]" >&2
	   exit 2 ;;
	esac
done
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "bad --rounds: $ROUNDS" >&2; exit 2; }
ROUND=1
if [ -n "$quick" ]; then
	SIZE_MB=256 RT=${runtime:-2} DD_BIG=1
else
	# Ten 100 MB transfers: five took 0.13-0.2 s at the guest's speed,
	# too short a run for its ratio to settle (0.63x-0.89x over rounds)
	SIZE_MB=1024 RT=${runtime:-5} DD_BIG=10
fi
SIZE=$((SIZE_MB << 20))
OUT=${VM_OUT:-/tmp}
RAW=$OUT/raw
rm -rf "$RAW" && mkdir -p "$RAW"
NRUN=0
W=$SCRATCH/bench
DEVS="loop-raw dm-file dm-loop qemu-nbd"

say() { echo "bench: $*"; }

# ---- setup ------------------------------------------------------------------

setup() {
	# It formats /dev/vda: never outside a guest of scripts/vm-run
	[ "${VM_GUEST:-}" = 1 ] || { say "run me through scripts/bench"; return 1; }
	mkdir -p "$SCRATCH" || return 1
	if [ -b /dev/vda ]; then
		# Inode tables and journal written now: ext4's lazy init would
		# otherwise write them in the background under the first runs
		mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 \
			/dev/vda && mount /dev/vda "$SCRATCH" || return 1
	else
		say "no /dev/vda: images on tmpfs, figures meaningless"
		mount -t tmpfs -o size=6g tmpfs "$SCRATCH" || return 1
	fi
	mkdir -p "$W" || return 1
	modprobe dm-mod && modprobe loop && modprobe nbd max_part=0 || return 1
	lsmod | grep -q '^dm_qcow2 ' || insmod "$QCOW2_KO" || return 1
}

# ---- devices ----------------------------------------------------------------

DEV='' DEV_KIND='' DEV_LOOP='' DEV_NBD_PID=''

# dev_up KIND IMG: serve IMG (raw for loop-raw, qcow2 otherwise) and set DEV.
dev_up() {
	local kind=$1 img=$2 len d pid
	DEV='' DEV_KIND=$kind DEV_LOOP='' DEV_NBD_PID=''
	case $kind in
	loop-raw)
		DEV=$(losetup -f --show --direct-io=on "$img") || return 1
		DEV_LOOP=$DEV
		;;
	dm-file)
		len=$(img_sectors "$img") || return 1
		DM_LEN=$len dm_create bench "$img" || return 1
		DEV=/dev/mapper/bench
		;;
	dm-loop)
		len=$(img_sectors "$img") || return 1
		DEV_LOOP=$(losetup -f --show --direct-io=on "$img") || return 1
		DM_LEN=$len dm_create bench "$DEV_LOOP" || return 1
		DEV=/dev/mapper/bench
		;;
	qemu-nbd)
		for d in /sys/block/nbd*; do
			[ -e "$d/pid" ] || break
		done
		d=/dev/${d##*/}
		qemu-nbd -f qcow2 --cache=none --aio=native -c "$d" "$img" ||
			return 1
		for _ in $(seq 100); do
			[ -e "/sys/block/${d#/dev/}/pid" ] && break
			sleep 0.1
		done
		pid=$(cat "/sys/block/${d#/dev/}/pid") || return 1
		DEV_NBD_PID=$(awk '/^Tgid:/ {print $2}' "/proc/$pid/status")
		DEV=$d
		;;
	esac
	[ -b "$DEV" ]
}

dev_down() {
	case $DEV_KIND in
	dm-file|dm-loop) dm_remove bench || return 1 ;;
	qemu-nbd)
		qemu-nbd -d "$DEV" >/dev/null || return 1
		# The server must have closed the image before it is reused
		for _ in $(seq 300); do
			[ -d "/proc/${DEV_NBD_PID:-none}" ] || break
			sleep 0.1
		done
		;;
	esac
	[ -z "$DEV_LOOP" ] || losetup -d "$DEV_LOOP"
	DEV='' DEV_KIND='' DEV_LOOP=''
}

# cache bytes and bound of the dm device, "-" for others
dev_cache() {
	case $DEV_KIND in
	dm-file|dm-loop) dm_status_field bench 4 ;;
	*) echo - ;;
	esac
}

# ---- images -------------------------------------------------------------------

# The loop backend of dm-qcow2 cannot grow the image: leave it room.
grow_for_loop() {
	truncate -s $((SIZE * 5 / 4 + (32 << 20))) "$1"
}

# empty_img KIND SIZE: a fresh empty image for KIND; prints its path.
empty_img() {
	local kind=$1 size=${2:-$SIZE} f
	rm -f "$W"/empty.*
	case $kind in
	loop-raw)
		f=$W/empty.raw
		truncate -s "$size" "$f" || return 1
		;;
	*)
		f=$W/empty.qcow2
		qemu-img create -q -f qcow2 "$f" "$size" || return 1
		[ "$kind" != dm-loop ] || grow_for_loop "$f" || return 1
		;;
	esac
	echo "$f"
}

# The preallocated pair: a raw file holding data everywhere and a qcow2
# image with every cluster allocated, holding the same data.
prealloc_imgs() {
	rm -f "$W"/pre.*
	fallocate -l "$SIZE" "$W/pre.raw" || return 1
	fio --name=fill --filename="$W/pre.raw" --rw=write --bs=1M \
		--direct=1 --ioengine=libaio --iodepth=4 --size="$SIZE" \
		--output=/dev/null || return 1
	qemu-img convert -f raw -O qcow2 "$W/pre.raw" "$W/pre.qcow2" || return 1
	sync
}

prealloc_img() {
	case $1 in
	loop-raw) echo "$W/pre.raw" ;;
	*) echo "$W/pre.qcow2" ;;
	esac
}

# ---- workloads ----------------------------------------------------------------

# name kind spec: fio: rw bs iodepth numjobs [fua]; dd: direction bs flag
# count. "fua": O_DSYNC, which direct asynchronous writes to a block device
# turn into FUA writes (what a guest's journal commits are).
WORKLOADS="
rr4k-q1   fio randread  4k 1  1
rr4k-q32  fio randread  4k 32 1
rw4k-q1   fio randwrite 4k 1  1
rw4k-q32  fio randwrite 4k 32 1
rw4k-fua-q32 fio randwrite 4k 32 1 fua
rrw4k-q1  fio randrw    4k 1  1
rrw4k-q32 fio randrw    4k 32 1
rr4k-j4   fio randread  4k 1  4
rr4k-j16  fio randread  4k 1  16
rw4k-j4   fio randwrite 4k 1  4
rw4k-j16  fio randwrite 4k 1  16
sr64k     fio read      64k 4 1
sw64k     fio write     64k 4 1
sr1m      fio read      1m 4  1
sw1m      fio write     1m 4  1
dd-w100M-direct dd w 100M direct big
dd-w100M-dsync  dd w 100M dsync  big
dd-w4k-direct   dd w 4096 direct run
dd-w4k-dsync    dd w 4096 dsync  run
dd-w512-direct  dd w 512  direct run
dd-w512-dsync   dd w 512  dsync  run
dd-r100M        dd r 100M direct big
dd-r4k          dd r 4096 direct run
dd-r512         dd r 512  direct run
"

# A workload reads only: skipped on empty images (nothing to read).
is_read() {
	case $1 in
	rr4k-*|sr*|dd-r*) return 0 ;;
	esac
	return 1
}

# CPU ticks since boot: "user+nice system+irq+softirq"
cpu_ticks() {
	awk '/^cpu / {print $2 + $3, $4 + $7 + $8; exit}' /proc/stat
}

# win_sample STATFILE: "centiseconds usr_ticks sys_ticks sectors" now, with
# shell builtins only (the sampler must cost little CPU itself).
win_sample() {
	local u n s irq sirq rest up rs ws
	read -r _ u n s _ _ irq sirq rest </proc/stat
	read -r up rest </proc/uptime
	read -r _ _ rs _ _ _ ws rest <"$1"
	echo "${up/./} $((u + n)) $((s + irq + sirq)) $((rs + ws))"
}

# snore SECONDS: sleep without running a program. The root is 9p without a
# page cache, so every exec of sleep(1) reads it again, on the CPU the run
# measures (a profile showed 12 % of the samples in page faults). A read
# that times out on a pipe nobody writes to does the same in the shell.
SNORE_FD=
snore() {
	[ -n "$SNORE_FD" ] || exec {SNORE_FD}<> <(:)
	read -r -t "$1" -u "$SNORE_FD" _ || :
}

# cpu_window DEV OUT: the CPU spent while DEV is busy, away from the start
# and end of the run (under TCG, starting fio costs seconds of CPU). Waits
# for the first I/O, skips 0.3 s, then measures until the run is 60 %
# through or the device goes idle. Writes "centisecs usr sys sectors".
cpu_window() {
	local st a b last cur t0 t00 s1 n
	# No udev: /dev/mapper/NAME is a node of its own, not a link to dm-N
	case $1 in
	/dev/mapper/*)
		st=/sys/class/block/$(dmsetup info -c --noheadings -o blkdevname \
			"${1#/dev/mapper/}")/stat ;;
	*)	st=/sys/class/block/$(basename "$(readlink -f "$1")")/stat ;;
	esac
	read -r t00 _ _ s1 < <(win_sample "$st")
	for _ in $(seq 600); do
		snore 0.1
		read -r _ _ _ n < <(win_sample "$st")
		[ "$n" = "$s1" ] || break
		# The run ended without I/O (it failed): nothing to measure
		[ ! -e "$W/run.done" ] || break
	done
	snore 0.3
	a=$(win_sample "$st")
	b=$a
	read -r t0 _ _ last <<<"$a"
	for _ in $(seq $((RT * 6 * 4 / 10))); do
		snore 0.25
		cur=$(win_sample "$st")
		read -r _ _ _ n <<<"$cur"
		[ "$n" != "$last" ] || break
		b=$cur last=$n
	done
	local a1 a2 a3 a4 b1 b2 b3 b4
	read -r a1 a2 a3 a4 <<<"$a"
	read -r b1 b2 b3 b4 <<<"$b"
	# The last field: from the start to the first I/O (fio's start-up)
	echo "$((b1 - a1)) $((b2 - a2)) $((b3 - a3)) $((b4 - a4)) $((a1 - t00))" >"$2"
}

# --profile: perf samples every CPU while a run goes on (kernel call
# chains; fio's own user time is left out), and a report of the symbols
# that took the samples, with their callers. perf takes seconds to start
# under TCG, longer than a run: it starts with its events off, and the run
# begins once perf has acknowledged turning them on (a control fifo).
PROF_PID=
prof_start() {
	[ -n "$PROFILE" ] || return 0
	rm -f "$W/perf.ctl" "$W/perf.ack"
	mkfifo "$W/perf.ctl" "$W/perf.ack" || return 0
	perf record -q -a -g --kernel-callchains -F 499 -e cpu-clock -D -1 \
		--control "fifo:$W/perf.ctl,$W/perf.ack" -o "$W/perf.data" \
		-- sleep 3600 >/dev/null 2>&1 &
	PROF_PID=$!
	# Opening a fifo waits for perf to open it: bounded, should perf fail
	timeout 120 bash -c 'exec 8>"$1" 9<"$2"; echo enable >&8; read -r a <&9' \
		_ "$W/perf.ctl" "$W/perf.ack" ||
		say "perf did not start sampling: the profile may be empty"
}

prof_stop() {
	[ -n "$PROF_PID" ] || return 0
	kill -INT "$PROF_PID" 2>/dev/null
	wait "$PROF_PID"
	PROF_PID=
	rm -f "$W/perf.ctl" "$W/perf.ack"
}

prof_report() {
	[ -n "$PROFILE" ] && [ -f "$W/perf.data" ] || return 0
	{
		echo "== self: where the samples fell (native_safe_halt: idle)"
		perf report -i "$W/perf.data" --stdio --no-children -g none \
			--sort sym --percent-limit 0.5 2>/dev/null
		echo "== children: each function with what it called (kernel)"
		perf report -i "$W/perf.data" --stdio --children -g none \
			--sort sym --percent-limit 0.5 2>/dev/null
		echo "== callers of the top symbols"
		perf report -i "$W/perf.data" --stdio --no-children \
			--sort sym --percent-limit 2 -g caller,0.5,2 2>/dev/null
	} >"$1"
	rm -f "$W/perf.data"
}

# run_one STATE DEVKIND WORKLOAD [SIZE_LIMIT]: run on $DEV, append a record.
run_one() {
	local state=$1 dk=$2 wl=$3 lim=${4:-$SIZE} kind a b c d e u0 s0 u1 s1
	local raw=$W/out.txt rc cache bs count win wcs wu ws wsec wst f t0=$SECONDS
	# shellcheck disable=SC2046
	set -- $(echo "$WORKLOADS" | awk -v w="$wl" '$1 == w {print $2, $3, $4, $5, $6, $7}')
	kind=$1 a=$2 b=$3 c=$4 d=${5:-} e=${6:-}
	settle
	prof_start	# before the CPU counts: its start-up is not the run's
	read -r u0 s0 < <(cpu_ticks)
	rm -f "$W/win.txt" "$W/run.done"
	cpu_window "$DEV" "$W/win.txt" &
	win=$!
	case $kind in
	fio)
		# The buffers start on a 2 MiB boundary so that they sit on
		# huge pages in every run. Left to malloc, a 1 MiB buffer lands
		# on a huge page or on 256 scattered ones as the address falls,
		# and the scattered one costs the disk two requests of 254
		# segments: a run's speed then changed by 1.7x with no change
		# in the device (Documentation/benchmarks/history.md).
		fio --name="$wl" --filename="$DEV" --rw="$a" --bs="$b" \
			--iodepth="$c" --numjobs="$d" --direct=1 --ioengine=libaio \
			--iomem_align=2m \
			${e:+--sync=1} --size="$lim" --time_based --runtime="$RT" \
			--group_reporting \
			--randrepeat=0 --norandommap --output-format=json \
			--output="$raw" >/dev/null 2>&1
		rc=$?
		;;
	dd)
		bs=$b
		count=$((lim / $(numfmt --from=iec "$bs")))
		[ "$d" != big ] || [ "$count" -le "$DD_BIG" ] || count=$DD_BIG
		# SIGINT makes dd print what it did so far and stop. Without
		# --foreground, timeout sends it twice (to dd, then to its
		# process group), and dd's handler is one-shot: a second SIGINT
		# that lands after the first was taken kills dd silently.
		if [ "$a" = w ]; then
			timeout --foreground -s INT $((RT * 2)) \
				dd if=/dev/zero of="$DEV" bs="$bs" \
				count="$count" oflag="$c" 2>"$raw"
		else
			timeout --foreground -s INT $((RT * 2)) \
				dd if="$DEV" of=/dev/null bs="$bs" \
				count="$count" iflag="$c" 2>"$raw"
		fi
		rc=$?
		[ $rc -ne 124 ] || rc=0
		;;
	esac
	read -r u1 s1 < <(cpu_ticks)
	touch "$W/run.done"
	wait "$win"
	prof_stop
	read -r wcs wu ws wsec wst <"$W/win.txt" || wcs=0 wu=0 ws=0 wsec=0 wst=0
	cache=$(dev_cache)
	# Parsed on the host (bench-report.py): python costs seconds under TCG
	NRUN=$((NRUN + 1))
	f=$RAW/$(printf %03d $NRUN)-$state-$dk-$wl
	mv "$raw" "$f.out" 2>/dev/null || : >"$f.out"
	prof_report "$f.perf.txt"
	echo "kind=$kind state=$state dev=$dk wl=$wl rc=$rc" \
		"usr_ticks=$((u1 - u0)) sys_ticks=$((s1 - s0)) hz=$(getconf CLK_TCK)" \
		"cache=$cache bs=$(numfmt --from=iec "${b^^}") win_cs=$wcs" \
		"win_usr=$wu win_sys=$ws win_sectors=$wsec start_cs=$wst" \
		"wall=$((SECONDS - t0)) round=$ROUND" \
		>"$f.meta"
	say "$state $dk $wl (round $ROUND): rc $rc, $((SECONDS - t0)) s (first I/O after ${wst}0 ms)"
}

# ---- the runs -------------------------------------------------------------------

# The devices in the order for round $ROUND and the workload at index $1
# (default 0): the list rotated by one a round and one a workload, so
# that no device always runs first or after the same one.
round_devs() {
	local -a d
	read -ra d <<<"$DEVS"
	local n=${#d[@]} i
	for ((i = 0; i < n; i++)); do
		printf '%s ' "${d[$(((i + ROUND - 1 + ${1:-0}) % n))]}"
	done
}

# The workloads picked by --only, one a line
picked() {
	echo "$WORKLOADS" | awk 'NF {print $1}' | grep -E -- "$only"
}

# Wait until nothing has been written to the scratch disk for a second
# (write-back of the image preparation, journal commits), up to 60 s.
settle() {
	local a b
	sync
	for _ in $(seq 60); do
		a=$(cat /sys/block/vda/stat 2>/dev/null)
		sleep 1
		b=$(cat /sys/block/vda/stat 2>/dev/null)
		[ "$(echo "$a" | awk '{print $7}')" != \
		  "$(echo "$b" | awk '{print $7}')" ] || return 0
	done
}

# Each workload runs on every device in turn before the next workload, a
# device served afresh for each run: the emulated host's speed moves by
# 2x-3x over minutes, and a device's ratio to loop-raw is only sound
# when both ran within the same minute or so.
run_prealloc() {
	local dk img wl i=0
	for wl in $(picked); do
		for dk in $(round_devs "$i"); do
			img=$(prealloc_img "$dk")
			dev_up "$dk" "$img" ||
				{ say "cannot serve $img as $dk"; dev_down; continue; }
			run_one prealloc "$dk" "$wl"
			dev_down || say "cannot remove $dk"
		done
		i=$((i + 1))
	done
}

run_empty() {
	local dk img wl i=0
	for wl in $(picked); do
		is_read "$wl" && continue
		for dk in $(round_devs "$i"); do
			img=$(empty_img "$dk") || { say "no image"; continue; }
			dev_up "$dk" "$img" ||
				{ say "cannot serve $img as $dk"; dev_down; continue; }
			run_one empty "$dk" "$wl"
			dev_down || say "cannot remove $dk"
		done
		i=$((i + 1))
	done
	rm -f "$W"/empty.*
}

# A 1 TiB virtual image and a 1 GiB one, same working set (the first
# 256 MiB): random writes allocate it, random reads then read it back.
run_big() {
	local vs img wl
	for vs in 1G 1T; do
		img=$W/ws-$vs.qcow2
		rm -f "$img"
		qemu-img create -q -f qcow2 "$img" "$vs" || continue
		dev_up dm-file "$img" || { say "cannot serve $img"; dev_down; continue; }
		for wl in rw4k-q32 rr4k-q32; do
			run_one "ws-$vs" dm-file "$wl" $((256 << 20))
		done
		echo "$vs $(dmsetup status bench)" >>"$OUT/status-ws.txt"
		dev_down
		rm -f "$img"
	done
}

start=$SECONDS
setup || { say "setup failed"; exit 1; }
{
	echo "mode=$([ -n "$quick" ] && echo quick || echo full) size_mb=$SIZE_MB runtime=$RT rounds=$ROUNDS${PROFILE:+ profiled}"
	echo "kernel=$(uname -r) cpus=$(nproc)"
	grep -m1 'model name' /proc/cpuinfo
	fio --version
	qemu-nbd --version | head -n 1
} >"$OUT/bench-env.txt"
if [[ prealloc =~ $STATES ]]; then
	say "preparing the preallocated images ($SIZE_MB MiB)"
	prealloc_imgs || { say "cannot make the images"; exit 1; }
	settle
	say "prealloc images ready after $((SECONDS - start)) s"
	for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
		run_prealloc
	done
	rm -f "$W"/pre.*
	say "prealloc done after $((SECONDS - start)) s"
fi
if [[ empty =~ $STATES ]]; then
	for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
		run_empty
	done
	say "empty done after $((SECONDS - start)) s"
fi
ROUND=1
[[ big =~ $STATES ]] && run_big
say "all done after $((SECONDS - start)) s"
echo "guest_seconds=$((SECONDS - start))" >>"$OUT/bench-env.txt"
cleanup_all
exit 0
