# shellcheck shell=bash
# Images on NFS (tests/vm/nfs-lib.sh: the kernel NFS server in this
# guest, two clients standing in for two hosts). What only NFS can show:
#   - QEMU's locks, taken by a table on one host, are seen on the other:
#     the lock matrix of t-lock.sh with the holder on one client and the
#     other party on the second, against two QEMU processes on the two
#     clients as the oracle;
#   - the server goes away and comes back (nfsd stopped and started):
#     on a hard mount, I/O and removal wait for it; the client reclaims
#     its locks, or, when the server lost its record of its clients, the
#     target fails the I/O that needed them and enters fail mode; the
#     image is never corrupt and what was flushed reads back;
#   - the server goes away for good under a soft mount: I/O fails, the
#     target enters fail mode and can be removed, and once the server is
#     back the image is not corrupt and holds what was flushed.
# The suite also runs cases of t-write.sh, t-crash.sh, t-fault.sh and
# t-lock.sh with their images on NFS ("nfs:FILE" in run-guest.sh).

# The helpers of t-fault.sh (and so t-write.sh's) and t-lock.sh, not
# their cases
# shellcheck source=tests/vm/t-fault.sh
. "$(dirname "${BASH_SOURCE[0]}")/t-fault.sh"
# shellcheck source=tests/vm/t-lock.sh
. "$(dirname "${BASH_SOURCE[0]}")/t-lock.sh"
for fn in $(declare -F | awk '{print $3}' | grep '^test_'); do
	unset -f "$fn"
done
# shellcheck source=tests/vm/nfs-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/nfs-lib.sh"
nfs_scratch || return 1

NFS_SOFT=/tmp/nfs-soft

# on_nfs2 PATH: the same file as PATH (under NFS1), through the second
# client's mount.
on_nfs2() {
	echo "$NFS2${1#"$NFS1"}"
}

# n_write DEV PATTERN OFFSET LENGTH: write a byte pattern through DEV
# (direct I/O) and flush it.
n_write() {
	qemu-io -f raw -t none -c "write -P $2 $3 $4" -c flush "$1" >/dev/null
}

# n_read_back IMG PATTERN OFFSET LENGTH: the image reads the pattern.
n_read_back() {
	qemu-io -f qcow2 -r -c "read -P $2 $3 $4" "$1" | grep -q 'read .* bytes' ||
		fail "$1 does not hold pattern $2 at $3 (+$4)"
}

# n_cleanup: EXIT trap: the server runs again, the soft mount goes.
n_cleanup() {
	nfs_server_start >/dev/null 2>&1
	l_cleanup
	mountpoint -q "$NFS_SOFT" && umount -f "$NFS_SOFT"
}

# Locks cross hosts: with the holder on the first client and the other
# party on the second, every pair is allowed or refused as between two
# QEMU processes on the two clients, and those refuse a writer beside a
# writer (the locks reach the server).
test_lock_matrix_two_hosts() {
	local img
	l_newdir nm || return 1
	img=$PWD/a.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	[ "$(lock_pair q_rw q_rw "$img" "$(on_nfs2 "$img")")" = refused ] ||
		fail "QEMU on the second client does not see the first's locks" ||
		return 1
	lock_matrix "$img" "$(on_nfs2 "$img")"
}

# restart_case keep|forget: the server stops under a writable table on a
# hard mount: a write and its flush wait for it, and so does removal.
#   keep:   the server keeps its record of its clients (nfsdcld): when it
#           is back, the client reclaims its opens and locks in the grace
#           period, the write completes, the second client is still
#           refused, and removal (with the server down again) writes
#           everything back once it returns.
#   forget: the server comes back without that record: the reclaim is
#           refused, the NFS client says "lost N locks" and fails I/O
#           under them, and the target fails the write and enters fail
#           mode (nobody guarantees any more that it is the image's only
#           writer); removal completes once the server is back.
# Either way nothing is corrupt, what was flushed before the outage reads
# back, and a new table takes the locks again.
restart_case() {
	local mode=$1 img pid rc=0
	l_newdir "nr-$mode" || return 1
	trap n_cleanup EXIT
	img=$PWD/a.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	dm_create nr "$img" || return 1
	must n_write /dev/mapper/nr 0xa1 0 8M || return 1

	nfs_server_stop || fail "cannot stop nfsd" || return 1
	[ "$mode" = keep ] || nfs_server_forget || return 1
	n_write /dev/mapper/nr 0xa2 8M 8M &
	pid=$!
	sleep 5
	kill -0 $pid 2>/dev/null ||
		fail "a write completed with the server down" || return 1
	must nfs_server_start || return 1
	bg_wait $pid 180 || rc=$?
	[ $rc != 2 ] || return 1
	if [ "$mode" = keep ]; then
		[ $rc = 0 ] || fail "the write failed after the server came back" ||
			return 1
		qemu_refused qemu-img info "$(on_nfs2 "$img")" || return 1
		# dirty metadata for the removal below to write back
		qemu-io -f raw -t none -c "write -P 0xa3 16M 8M" \
			/dev/mapper/nr >/dev/null || fail "write 0xa3" || return 1
	else
		[ $rc != 0 ] || fail "the write completed without its lock" ||
			return 1
		dmesg | tail -n 50 | grep -qE 'NFS: .*lost [0-9]+ locks' ||
			fail "the write failed, but no lock was lost" || return 1
		[ "$(dm_mode nr)" = fail ] ||
			fail "mode $(dm_mode nr) after the locks were lost" ||
			return 1
		log "locks lost: the write failed, mode $(dm_mode nr)"
	fi

	nfs_server_stop || return 1
	dmsetup remove nr &
	pid=$!
	sleep 5
	kill -0 $pid 2>/dev/null ||
		fail "removal completed with the server down" || return 1
	must nfs_server_start || return 1
	rc=0
	bg_wait $pid 180 || rc=$?
	[ $rc = 0 ] || fail "removal failed after the server came back" ||
		return 1

	no_corruption "$img" && n_read_back "$img" 0xa1 0 8M || return 1
	if [ "$mode" = keep ]; then
		n_read_back "$img" 0xa2 8M 8M && n_read_back "$img" 0xa3 16M 8M ||
			return 1
	fi
	# a new table: the image is locked again
	dm_create nr "$img" || return 1
	qemu_refused qemu-img info "$(on_nfs2 "$img")" || return 1
	must dm_remove nr
}

test_server_restart()	{ restart_case keep; }
test_server_forgets()	{ restart_case forget; }

# The server goes away under a soft mount: writes and the flush fail
# within seconds, the target enters fail mode, removal completes with the
# server still down; once it is back the image is not corrupt and holds
# what was flushed before.
test_soft_server_gone() {
	local img pid rc=0 ev0
	trap n_cleanup EXIT
	mkdir -p "$NFS_SOFT" || return 1
	must mount -t nfs4 -o vers=4.2,soft,timeo=10,retrans=1 \
		127.0.0.1:/ "$NFS_SOFT" || return 1
	rm -rf "$NFS1/scratch/ns" && mkdir -p "$NFS1/scratch/ns" || return 1
	# the case's own files (fio's output, A) off NFS: nothing of the test
	# itself may wait for the server
	rm -rf /tmp/nfs-ns && mkdir -p /tmp/nfs-ns && cd /tmp/nfs-ns || return 1
	img=$NFS_SOFT/scratch/ns/a.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	dm_create ns "$img" || return 1
	write_a /dev/mapper/ns || return 1
	ev0=$(dm_events ns)

	fio_flushing /dev/mapper/ns 16M 40M 64M --time_based --runtime=100 \
		>fio.out 2>&1 &
	pid=$!
	sleep 2
	nfs_server_stop || fail "cannot stop nfsd" || return 1
	bg_wait $pid 180 || rc=$?
	[ $rc -ne 2 ] || return 1
	[ $rc -ne 0 ] || fail "fio saw no error" || return 1
	log "fio: $(grep -oE 'err= *[0-9]+[^,]*' fio.out | head -n 1)"
	must_fail 'Input/output error' fsync_path /dev/mapper/ns || return 1
	expect_event ns "$ev0" || return 1
	[ "$(dm_mode ns)" = fail ] ||
		fail "mode $(dm_mode ns) with the server gone" || return 1
	timeout 180 dmsetup remove ns ||
		fail "removal did not complete with the server gone" || return 1

	must nfs_server_start || return 1
	umount "$NFS_SOFT" || umount -f "$NFS_SOFT" || return 1
	img=$NFS1/scratch/ns/a.qcow2
	no_corruption "$img" && same_head a.raw "$img"
}
