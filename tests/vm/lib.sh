# shellcheck shell=bash
# Common helpers for the tests that run inside the VM (sourced).
#
# A test file defines functions named test_*; run-guest.sh sources it and
# runs each one as a case. A case passes when its function returns 0 and
# the kernel log written during the case shows no splat.

QCOW2_TOP=${QCOW2_TOP:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
QCOW2_KO=${QCOW2_KO:-$QCOW2_TOP/drivers/md/dm-qcow2.ko}
SCRATCH=${SCRATCH:-/tmp/scratch}

# Say why a case failed, and fail it.
fail() {
	echo "  FAIL: $*" >&2
	return 1
}

log() {
	echo "  $*"
}

# Run a command; fail the case with its output if it fails.
must() {
	local out
	if ! out=$("$@" 2>&1); then
		echo "$out" | tail -n 20 >&2
		fail "command failed: $*"
		return 1
	fi
	[ -z "${VERBOSE:-}" ] || echo "$out"
}

# ---- trace events (drivers/md/dm-qcow2-trace.h) ----

TRACEFS=/sys/kernel/tracing

# trace_start EVENT[:FILTER]...: record these dm_qcow2 events from now on,
# into an empty buffer (FILTER: the event's filter, "held > 1").
trace_start() {
	local spec ev
	[ -d "$TRACEFS/events" ] || mount -t tracefs nodev "$TRACEFS" ||
		fail "cannot mount tracefs" || return 1
	echo 0 >"$TRACEFS/tracing_on"
	echo 0 >"$TRACEFS/events/enable"
	echo 16384 >"$TRACEFS/buffer_size_kb"
	: >"$TRACEFS/trace"
	for spec; do
		ev=${spec%%:*}
		[ -d "$TRACEFS/events/dm_qcow2/$ev" ] ||
			fail "no trace event dm_qcow2:$ev" || return 1
		if [ "$spec" != "$ev" ]; then
			echo "${spec#*:}" >"$TRACEFS/events/dm_qcow2/$ev/filter"
		else
			echo 0 >"$TRACEFS/events/dm_qcow2/$ev/filter"
		fi || fail "bad filter for $ev: ${spec#*:}" || return 1
		echo 1 >"$TRACEFS/events/dm_qcow2/$ev/enable" ||
			fail "cannot enable dm_qcow2:$ev" || return 1
	done
	echo 1 >"$TRACEFS/tracing_on"
}

# trace_count EVENT [FIELD]: stop recording; how many EVENT lines were
# recorded since trace_start, or the sum of their FIELD values. Fails when
# the buffer lost events.
trace_count() {
	echo 0 >"$TRACEFS/tracing_on"
	! grep -q '^overrun: [1-9]' "$TRACEFS"/per_cpu/cpu*/stats ||
		fail "the trace buffer lost events" || return 1
	awk -v ev="$1:" -v f="${2:-}" '{
		for (i = 1; i < NF; i++) {
			if ($i != ev)
				continue
			if (f == "")
				n++
			for (j = i + 1; f != "" && j < NF; j++)
				if ($j == f) {
					n += $(j + 1)
					break
				}
			break
		}
	} END { print n + 0 }' "$TRACEFS/trace"
}

# trace_positive EVENT...: fail unless each EVENT was recorded since
# trace_start (the filters set there apply), and log the counts.
trace_positive() {
	local ev n
	for ev; do
		n=$(trace_count "$ev") || return 1
		log "trace: $ev $n"
		[ "$n" -gt 0 ] || fail "no $ev event" || return 1
	done
}

# Sectors of a qcow2 image's virtual size.
img_sectors() {
	qemu-img info -U --output=json "$1" |
		python3 -c 'import json,sys; print(json.load(sys.stdin)["virtual-size"] // 512)'
}

# dm_create NAME TABLE_REST [dmsetup options...]: creates NAME with
# "0 <len> qcow2 TABLE_REST" where len comes from the image named first in
# TABLE_REST unless DM_LEN is set. The node is made without udev.
dm_create() {
	local name=$1 rest=$2 len
	shift 2
	if [ -n "${DM_LEN:-}" ]; then
		len=$DM_LEN
	else
		len=$(img_sectors "${rest%% *}") || return 1
	fi
	dmsetup create "$name" "$@" --table "0 $len qcow2 $rest" || return 1
	dmsetup mknodes "$name"
	[ -b "/dev/mapper/$name" ] || fail "no node for $name"
}

dm_remove() {
	dmsetup remove "$1" 2>/dev/null || { sleep 1; dmsetup remove "$1"; }
}

# Remove every dm-qcow2 device and loop device left by a failed case.
cleanup_all() {
	local d
	for d in $(dmsetup ls --target qcow2 2>/dev/null | awk '$1 != "No" {print $1}'); do
		dmsetup remove --force "$d" >/dev/null 2>&1 || true
	done
	losetup -D 2>/dev/null || true
}

# One field of "dmsetup status" (1 = first field after the target name).
dm_status_field() {
	dmsetup status "$1" | awk -v f="$2" '{print $(3 + f)}'
}

# The last "qcow2:" error logged by the kernel since the case began.
last_dm_error() {
	dmesg | tail -n 20 | grep -E 'device-mapper: table: .*qcow2: ' | tail -n 1
}

# expect_refused NAME TABLE_REST MESSAGE [dmsetup options]: creating the
# device must fail, and the kernel log must show MESSAGE as the reason.
expect_refused() {
	local name=$1 rest=$2 msg=$3 len
	shift 3
	len=${DM_LEN:-8}
	if dmsetup create "$name" "$@" --table "0 $len qcow2 $rest" 2>/dev/null; then
		dm_remove "$name"
		fail "table '$rest' was accepted"
		return 1
	fi
	if ! dmesg | tail -n 5 | grep -qF -- "qcow2: $msg"; then
		fail "expected '$msg', kernel said: $(last_dm_error)"
		return 1
	fi
}
