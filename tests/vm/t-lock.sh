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
	local img=$1 pid out
	shift
	out=$(mktemp)
	qemu-io "$@" -c 'sleep 600000' "$img" >"$out" 2>&1 &
	pid=$!
	L_PIDS+=("$pid")
	for _ in $(seq 1 300); do
		# QEMU's locks are open file description locks (/proc/locks:
		# OFDLCK), or POSIX ones of its process where its probe for
		# OFD locks failed (seen now and then on NFS)
		grep -qE "OFDLCK|POSIX +ADVISORY +[A-Z]+ +$pid " /proc/locks &&
			{ rm -f "$out"; return 0; }
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	fail "qemu-io $* did not open $img: $(cat "$out")"
	if kill -0 "$pid" 2>/dev/null; then
		echo "  qemu-io is waiting in:" >&2
		cat "/proc/$pid/stack" /proc/locks >&2
	fi
	rm -f "$out"
	return 1
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

# ---- the lock matrix ------------------------------------------------------
# Five ways to use an image: a writable table (dm_rw), a read-only table
# (dm_ro), a QEMU writer (q_rw), a QEMU reader (q_ro) and a QEMU reader
# with force share (q_U, "qemu-img -U"). For every ordered pair, the
# first holds the image and the second tries to open it; a table must be
# allowed or refused exactly as QEMU is when QEMU stands in its place (a
# writable table as a writer, a read-only one as a reader), and two QEMU
# processes are the oracle of what QEMU does.
LOCK_ROLES=(dm_rw dm_ro q_rw q_ro q_U)

# lock_as_qemu ROLE: the QEMU role a table stands for.
lock_as_qemu() {
	case $1 in
	dm_rw) echo q_rw ;;
	dm_ro) echo q_ro ;;
	*) echo "$1" ;;
	esac
}

# lock_qemu_opts ROLE: qemu-io's options for a QEMU role.
lock_qemu_opts() {
	case $1 in
	q_rw) echo "-f qcow2" ;;
	q_ro) echo "-f qcow2 -r" ;;
	q_U) echo "-f qcow2 -r -U" ;;
	esac
}

# lock_hold ROLE IMG: ROLE holds IMG open until l_cleanup.
lock_hold() {
	local opts
	case $1 in
	dm_rw) DM_LEN=131072 dm_create lm1 "$2" ;;
	dm_ro) DM_LEN=131072 dm_create lm1 "$2" --readonly ;;
	*)
		read -ra opts <<<"$(lock_qemu_opts "$1")"
		qemu_holds "$2" "${opts[@]}"
		;;
	esac
}

# lock_try ROLE IMG: ROLE opens IMG beside the holder; prints "allowed"
# or "refused" (refused on a lock or in-use error only, anything else is
# "error: ..."), and lets the image go again.
lock_try() {
	local -a opts=()
	local out
	case $1 in
	dm_rw | dm_ro)
		[ "$1" = dm_rw ] || opts=(--readonly)
		if dmsetup create lm2 "${opts[@]}" \
			--table "0 131072 qcow2 $2" 2>/dev/null; then
			dm_remove lm2 && echo allowed
		elif dmesg | tail -n 5 | grep -qE 'qcow2: Image is (locked|in use)'; then
			echo refused
		else
			echo "error: $(last_dm_error)"
		fi
		;;
	*)
		read -ra opts <<<"$(lock_qemu_opts "$1")"
		if out=$(qemu-io "${opts[@]}" -c 'read 0 512' "$2" 2>&1); then
			echo allowed
		elif echo "$out" | grep -q -- "$QEMU_LOCK_MSG"; then
			echo refused
		else
			echo "error: $out"
		fi
		;;
	esac
}

# lock_pair FIRST SECOND IMG1 IMG2: what SECOND gets on IMG2 while FIRST
# holds IMG1 (the same file, perhaps by another path or another host).
lock_pair() {
	if lock_hold "$1" "$3" >&2; then
		lock_try "$2" "$4"
	else
		echo "error: $1 cannot hold"
	fi
	l_cleanup
}

# lock_matrix IMG1 IMG2: every pair, the holder on IMG1 and the other on
# IMG2, against the QEMU oracle on IMG1 alone; one line per pair.
lock_matrix() {
	local f s want got bad=0
	for f in "${LOCK_ROLES[@]}"; do
		for s in "${LOCK_ROLES[@]}"; do
			want=$(lock_pair "$(lock_as_qemu "$f")" \
				"$(lock_as_qemu "$s")" "$1" "$1")
			got=$(lock_pair "$f" "$s" "$1" "$2")
			log "$f then $s: $got (QEMU: $want)"
			[ "$got" = "$want" ] && [[ $got != error* ]] || bad=1
		done
	done
	[ $bad = 0 ] || fail "the tables did not behave as QEMU does"
}

# Every pair of the five ways, in both orders, on one image (one path as
# the holder's, a hard link as the other's).
test_matrix() {
	l_newdir lm || return 1
	must qemu-img create -q -f qcow2 a.qcow2 64M || return 1
	must ln a.qcow2 link.qcow2 || return 1
	lock_matrix "$PWD/a.qcow2" "$PWD/link.qcow2"
}

# An image on a block device: the table locks the node it names, which
# QEMU opens (device-mapper's exclusive claim does not stop QEMU, which
# opens nodes without O_EXCL). The node is held open through a private
# mount of its own: /dev stays free to unmount (an initramfs moves its
# /dev away with the root on such a table: distro-test's bdev boots).
test_bdev_node_locked() {
	local loop
	l_newdir ld || return 1
	must truncate -s 128M disk.raw || return 1
	loop=$(losetup -f --show "$PWD/disk.raw") || return 1
	must qemu-img create -q -f qcow2 "$loop" 64M || return 1
	DM_LEN=131072 dm_create ld "$loop" || return 1
	qemu_refused qemu-img info "$loop" || return 1
	qemu_refused qemu-io -f qcow2 -c 'write 0 512' "$loop" || return 1
	must qemu-img info -U "$loop" || return 1
	must dm_remove ld || return 1
	must qemu-img check "$loop"
}
