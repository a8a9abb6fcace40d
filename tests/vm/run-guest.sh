#!/bin/bash
# Runs VM test files inside the guest (started by scripts/run-tests through
# scripts/vm-run). Usage: run-guest.sh FILE[:REGEX]...
#
# Each FILE defines test_* functions; REGEX picks some of them. Every case
# runs in a subshell, between two kernel log markers: it fails if it
# returns non-zero or if the kernel log of that case shows a splat.
# Results go to $VM_OUT/results.txt (one "PASS name" / "FAIL name" line
# each), the seconds each case took to $VM_OUT/times.txt ("name seconds",
# for balancing the suite's jobs); the last line printed is
# "N passed, N failed".
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tests/vm/lib.sh
. "$here/lib.sh"
results=${VM_OUT:-/tmp}/results.txt
times=${VM_OUT:-/tmp}/times.txt
: >"$results"
: >"$times"
passed=0
failed=0

record() {
	echo "$1 $2" >>"$results"
	if [ "$1" = PASS ]; then
		passed=$((passed + 1))
	else
		failed=$((failed + 1))
	fi
	echo "$1 $2"
}

# Scratch space for images: the first virtio disk if there is one. Its
# inode tables and journal are left unwritten and never zeroed in the
# background (noinit_itable), so no lazy-init writes run behind the
# cases (mkfs itself takes about 4 s either way).
setup_scratch() {
	mkdir -p "$SCRATCH"
	if [ -b /dev/vda ]; then
		mkfs.ext4 -q -F -E nodiscard,lazy_itable_init=1,lazy_journal_init=1 \
			/dev/vda && mount -o noinit_itable /dev/vda "$SCRATCH"
	else
		mount -t tmpfs -o size=4g tmpfs "$SCRATCH"
	fi
}

# Make dm-qcow2 loadable on demand: an overlay over the read-only module
# tree holds the module and a fresh modules.dep, made on the host by
# scripts/moddep when QCOW2_MODDEP names its directory (depmod -a here
# reads the whole tree over 9p: minutes under TCG).
setup_modules() {
	local kv m
	kv=$(uname -r)
	m=/lib/modules/$kv
	modprobe dm-mod && modprobe loop || return 1
	mkdir -p /tmp/modov/upper /tmp/modov/work
	mount -t overlay overlay \
		-o "lowerdir=$m,upperdir=/tmp/modov/upper,workdir=/tmp/modov/work" \
		"$m" || return 1
	mkdir -p "$m/extra" && cp "$QCOW2_KO" "$m/extra/" || return 1
	if [ -f "${QCOW2_MODDEP:-/none}/$kv/modules.dep" ]; then
		cp "$QCOW2_MODDEP/$kv"/modules.* "$m/"
	else
		depmod -a "$kv"
	fi
}

# QCOW2_FAIL_ALLOC=PERCENT: every case runs with that share of the
# target's own allocations in its I/O paths failing (the fail_dm_qcow2
# fault_attr in debugfs: a kernel with CONFIG_FAULT_INJECTION_DEBUG_FS,
# such as scripts/debug-kernel's); the case's log says how many failed.
FAIL_ALLOC_TIMES=100000000
fail_alloc_begin() {
	local d=/sys/kernel/debug/fail_dm_qcow2
	[ -n "${QCOW2_FAIL_ALLOC:-}" ] || return 0
	mountpoint -q /sys/kernel/debug || mount -t debugfs none /sys/kernel/debug
	modprobe dm-qcow2 || return 1
	[ -d $d ] || { fail "no $d (CONFIG_FAULT_INJECTION_DEBUG_FS)"; return 1; }
	echo 0 >$d/verbose && echo 0 >$d/space && echo 1 >$d/interval &&
		echo $FAIL_ALLOC_TIMES >$d/times &&
		echo "$QCOW2_FAIL_ALLOC" >$d/probability
}

fail_alloc_end() {
	local d=/sys/kernel/debug/fail_dm_qcow2
	[ -n "${QCOW2_FAIL_ALLOC:-}" ] && [ -d $d ] || return 0
	echo 0 >$d/probability
	echo "  fail_dm_qcow2: $((FAIL_ALLOC_TIMES - $(cat $d/times))) allocations failed"
}

run_case() {
	local name=$1 fn=$2 mark start=$SECONDS
	mark="dm-qcow2-test: begin $name $$-$RANDOM"
	echo "$mark" >/dev/kmsg
	echo "--- $name"
	fail_alloc_begin || { record FAIL "$name"; return; }
	if (cd "$SCRATCH" && "$fn"); then
		if "$QCOW2_TOP/scripts/dmesg-check" --since "$mark"; then
			record PASS "$name"
		else
			record FAIL "$name"
		fi
	else
		"$QCOW2_TOP/scripts/dmesg-check" --since "$mark" || true
		record FAIL "$name"
	fi
	fail_alloc_end
	cleanup_all
	echo "$name $((SECONDS - start))" >>"$times"
	echo "  $((SECONDS - start)) s"
}

# Each file is read in a subshell of its own: a file may redefine a helper
# of lib.sh for its cases (t-corrupt.sh's img_sectors), and that must not
# reach the files run after it. The counts are kept in $results.
# "nfs:FILE[:REGEX]" runs the cases with their images on NFS
# (tests/vm/nfs-lib.sh: the server in this guest, SCRATCH on its first
# client's mount); their names begin with "nfs/".
run_file() {
	local spec=$1 file regex fn prefix=
	if [[ $spec == nfs:* ]]; then
		spec=${spec#nfs:} prefix=nfs/
	fi
	file=${spec%%:*}
	regex=.
	[ "$file" = "$spec" ] || regex=${spec#*:}
	(
		if [ -n "$prefix" ]; then
			# shellcheck source=tests/vm/nfs-lib.sh
			. "$here/nfs-lib.sh"
			nfs_scratch || { record FAIL "${prefix}setup"; exit; }
		fi
		# shellcheck disable=SC1090
		. "$here/$file" || { record FAIL "$prefix$file"; exit; }
		for fn in $(declare -F | awk '{print $3}' | grep '^test_' | grep -E -- "$regex"); do
			run_case "$prefix${file%.sh}/${fn#test_}" "$fn"
		done
	)
	passed=$(grep -c '^PASS ' "$results")
	failed=$(grep -c '^FAIL ' "$results")
}

if ! setup_scratch || ! setup_modules; then
	record FAIL setup
	echo "$passed passed, $failed failed"
	exit 1
fi
for spec in "$@"; do
	run_file "$spec"
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
