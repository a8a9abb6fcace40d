#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
# A/B of two dm-qcow2 builds in one guest, for a change whose effect is
# smaller than the spread between guest runs under TCG: the modules are
# loaded in turn, each round, and each is measured against loop on a raw
# file in the same round. Runs in a scripts/vm-run guest with a scratch
# disk (/dev/vda, formatted here):
#
#   scripts/vm-run --fill --disk 4G --out DIR -- \
#	tests/vm/ab-dd.sh [--empty | --empty-direct] A.ko B.ko [ROUNDS]
#
# The .ko files must be readable in the guest (not under /tmp, which is
# the guest's own). Each round and module: create the device on a
# preallocated 1 GiB image, a 100 MB dsync dd just after create (slices
# not cached), the same into loop, the dd again (slices cached). Each dd
# line gives MB/s and the guest's system CPU seconds (system, irq and
# softirq ticks) it took.
#
# --empty: the same, on a new empty image and a sparse raw file each
# round and module: the dd cold allocates every cluster (write-back into
# new clusters: parking, held batches), the dd after it writes in place.
#
# --empty-direct: the bench's dd-w100M-direct row on an empty image
# instead, ten 100 MB direct writes from /dev/zero into a new empty image
# and a sparse raw file, once a round and module. Unlike fio's buffers
# on a 2 MiB boundary (ab-fio.sh), dd's buffer is cut into bios where its
# pages happen to be contiguous, so bios begin and end inside clusters.
set -u
AB_DD_EMPTY=
case ${1:-} in
--empty) AB_EMPTY=1; shift ;;
--empty-direct) AB_EMPTY=1 AB_DD_EMPTY=1; shift ;;
esac
# shellcheck source=tests/vm/ab-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_setup ab-dd
[ -n "$AB_DD_EMPTY" ] || head -c 100M /dev/urandom >/run/ab-dd.bin || exit 1

# one_dd LABEL DEV
one_dd() {
	local t0 t1 c0 c1 n=1
	ab_quiesce
	c0=$(ab_ticks) t0=$(date +%s.%N)
	if [ -n "$AB_DD_EMPTY" ]; then
		n=10
		dd if=/dev/zero of="$2" bs=100M count=$n oflag=direct \
			status=none || return 1
	else
		dd if=/run/ab-dd.bin of="$2" bs=100M count=1 oflag=dsync \
			status=none || return 1
	fi
	t1=$(date +%s.%N) c1=$(ab_ticks)
	echo "$1 $(echo "$t0 $t1 $c0 $c1 $n" | awk '{ printf "%.1f MB/s sys %.2f s",
		$5 * 104.8576 / ($2 - $1), ($4 - $3) / 100 }')"
}

# dd_round LABEL DM LOOP: just after create, into loop, then slices cached
dd_round() {
	one_dd "$1 dm cold" "$2" && one_dd "$1 loop" "$3" || return 1
	[ -n "$AB_DD_EMPTY" ] || one_dd "$1 dm warm" "$2"
}

ab_rounds "$1" "$2" "${3:-3}" dd_round
