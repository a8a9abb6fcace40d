# shellcheck shell=bash
# Images shared with QEMU and between tables (drivers/md/dm-qcow2-lock.c):
# a table holds QEMU's image locks on its image files, so QEMU's tools and
# QEMU itself see the image in use, and a table is refused an image that
# QEMU or another table uses in a way that could corrupt it. QEMU's own
# tools are the oracle: what they refuse and what they allow beside a
# table, with their own error messages.

QEMU_LOCK_MSG='Failed to get .* lock'

l_newdir() {
	rm -rf "${SCRATCH:?}/$1" && mkdir -p "$SCRATCH/$1" && cd "$SCRATCH/$1" ||
		return 1
	trap l_cleanup EXIT
}

L_PIDS=()
l_cleanup() {
	local p
	for p in "${L_PIDS[@]}"; do
		kill "$p" 2>/dev/null
		wait "$p" 2>/dev/null
	done
	L_PIDS=()
	cleanup_all
}

# qemu_refused CMD...: a QEMU tool must fail with QEMU's lock error.
qemu_refused() {
	local out
	if out=$("$@" 2>&1); then
		fail "'$*' succeeded beside the table"
		return 1
	fi
	echo "$out" | grep -q -- "$QEMU_LOCK_MSG" ||
		fail "'$*' failed, but not on a lock: $out"
}

# qemu_holds IMG OPTS...: qemu-io holding IMG open (sleeping) in the
# background, as a VM would; waits until it has the image open.
qemu_holds() {
	local img=$1
	shift
	qemu-io "$@" -c 'sleep 600000' "$img" >/dev/null 2>&1 &
	L_PIDS+=($!)
	for _ in $(seq 1 100); do
		# QEMU's locks are open file description locks: /proc/locks
		# lists them as OFDLCK
		grep -q OFDLCK /proc/locks && return 0
		sleep 0.1
	done
	fail "qemu-io did not open $img"
}

# A writable table: QEMU's readers and writers are refused with QEMU's
# error, "info -U" (force share) still reads; removal releases the image.
test_writer_locks_out_qemu() {
	local img
	l_newdir lw || return 1
	img=$PWD/a.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	dm_create lw "$img" || return 1
	qemu_refused qemu-img info "$img" || return 1
	qemu_refused qemu-io -f qcow2 -c 'read 0 512' "$img" || return 1
	qemu_refused qemu-io -f qcow2 -r -c 'read 0 512' "$img" || return 1
	qemu_refused qemu-img check "$img" || return 1
	# a QEMU guest (no accelerator needed to open its drive)
	qemu_refused timeout 30 qemu-system-x86_64 -machine none -nodefaults \
		-display none \
		-drive "file=$img,format=qcow2,if=none,id=d0" || return 1
	qemu_refused timeout 30 qemu-nbd -f qcow2 -k "$PWD/nbd.sock" "$img" ||
		return 1
	must qemu-img info -U "$img" || return 1
	must dm_remove lw || return 1
	must qemu-img info "$img" || return 1
	must qemu-io -f qcow2 -c 'write 0 512' "$img" || return 1
	must qemu-img check "$img"
}

# A read-only table is locked as a QEMU reader: QEMU may read alongside,
# nobody may write.
test_reader_shares_reads() {
	local img
	l_newdir lr || return 1
	img=$PWD/a.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	dm_create lr "$img" --readonly || return 1
	must qemu-img info "$img" || return 1
	must qemu-io -f qcow2 -r -c 'read 0 512' "$img" || return 1
	qemu_refused qemu-io -f qcow2 -c 'write 0 512' "$img" || return 1
	# a second read-only table of the same image
	dm_create lr2 "$img" --readonly || return 1
	must dm_remove lr2 && must dm_remove lr
}

# Backing images are locked as QEMU locks a backing file: read, never
# written, by anyone; their qemu-img info still works.
test_backing_locked() {
	local base top
	l_newdir lb || return 1
	base=$PWD/base.qcow2 top=$PWD/top.qcow2
	must qemu-img create -q -f qcow2 "$base" 64M || return 1
	must qemu-img create -q -f qcow2 -b "$base" -F qcow2 "$top" || return 1
	dm_create lb "$top 2 backing $base" || return 1
	must qemu-img info "$base" || return 1
	qemu_refused qemu-io -f qcow2 -c 'write 0 512' "$base" || return 1
	qemu_refused qemu-img info "$top" || return 1
	# a writable table of the backing image is refused too
	expect_refused lb2 "$base" "Image is in use: another dm-qcow2 device reads it" \
		|| return 1
	must dm_remove lb || return 1
	must qemu-io -f qcow2 -c 'write 0 512' "$base"
}

# The reverse: what QEMU holds, a table cannot take.
test_qemu_writer_refuses_table() {
	local img
	l_newdir lq || return 1
	img=$PWD/a.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	qemu_holds "$img" -f qcow2 || return 1
	DM_LEN=131072 expect_refused lq "$img" "Image is locked by another user" ||
		return 1
	DM_LEN=131072 expect_refused lq "$img" "Image is locked by another user" \
		--readonly || return 1
	l_cleanup
	trap l_cleanup EXIT
	# a QEMU reader: a read-only table may join it, a writable one not
	qemu_holds "$img" -f qcow2 -r || return 1
	DM_LEN=131072 expect_refused lq "$img" "Image is locked by another user" ||
		return 1
	dm_create lq "$img" --readonly || return 1
	must dm_remove lq
}

# Two writable tables of one image, by another path or a hard link, are
# refused; a reload of the same image by its own device is not, and the
# locks stay until the device is removed.
test_tables_and_reload() {
	local img
	l_newdir lt || return 1
	img=$PWD/a.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	must ln "$img" "$PWD/link.qcow2" || return 1
	dm_create lt "$img" || return 1
	DM_LEN=131072 expect_refused lt2 "$PWD/link.qcow2" \
		"Image is in use: another dm-qcow2 device writes it" || return 1
	DM_LEN=131072 expect_refused lt2 "$img" \
		"Image is in use: another dm-qcow2 device writes it" --readonly ||
		return 1
	must dd if=/dev/urandom of=/dev/mapper/lt bs=64k count=16 oflag=direct ||
		return 1
	must dmsetup reload lt --table "0 131072 qcow2 $PWD/link.qcow2" ||
		return 1
	must dmsetup suspend lt && must dmsetup resume lt || return 1
	must dd if=/dev/urandom of=/dev/mapper/lt bs=64k count=16 seek=32 \
		oflag=direct || return 1
	qemu_refused qemu-img info "$img" || return 1
	must dm_remove lt || return 1
	must qemu-img check "$img"
}
