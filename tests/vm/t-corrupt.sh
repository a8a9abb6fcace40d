# shellcheck shell=bash
# shellcheck disable=SC2154 # the layout variables come from eval (mk_image)
# Corruption met at run time: one bad table entry per case, made with
# qemu-img/qemu-io and a byte patch (qcow2-poke.py). The I/O that meets it
# fails with EIO, the kernel log says what is wrong, the status shows
# health "corrupt" and mode "ro"; a writable device also sets the corrupt
# bit (incompatible bit 1) in the header. Nothing is written through the
# bad pointer: the bytes it points at and the whole image past the header
# are checksummed before and after. Some cases are refused at table load
# instead (refcount table entries, read only by a writable table); each
# case says which the target does.
#
# Every image: qcow2 v3 (v2 where said), 4 KiB clusters, 16 MiB, guest
# clusters 0-15 written (0x5a) under L2 table A (L1[0]), 4 MiB + 64 KiB
# written (0xa5) under L2 table B (L1[2]). Patches touch L2 A entry 1
# (guest offset 4096) or L1[0].

# The helpers of the write tests (wdev_create, hdr_byte, ...) without
# their cases.
# shellcheck source=tests/vm/t-write.sh
. "$QCOW2_TOP/tests/vm/t-write.sh"
for fn in $(declare -F | awk '{print $3}' | grep '^test_'); do
	unset -f "$fn"
done

POKE=$QCOW2_TOP/tests/vm/qcow2-poke.py

# Every image here is 16 MiB: spare a qemu-img run per device (TCG)
img_sectors() {
	echo $((16 << 11))
}
COPIED=$((1 << 63))
COMPRESSED=$((1 << 62))
MASK=0x00fffffffffffe00

# mk_image [compat]: make c.qcow2 in a fresh directory and load its layout
# into the shell: cluster_size, l1_off, rt_off, rb_0, l1_0 (L2 A),
# l1_2 (L2 B); DATA1 is the host cluster of guest cluster 1.
mk_image() {
	local compat=${1:-1.1} tpl
	# One template per version per boot, copied for each case
	tpl=$SCRATCH/corrupt-template-$compat
	if [ ! -e "$tpl.layout" ]; then
		must qemu-img create -q -f qcow2 \
			-o "compat=$compat,cluster_size=4k" "$tpl.qcow2" 16M ||
			return 1
		qio -f qcow2 -c "write -P 0x5a 0 64k" \
			-c "write -P 0xa5 4M 64k" "$tpl.qcow2" || return 1
		python3 "$POKE" layout "$tpl.qcow2" >"$tpl.tmp" || return 1
		eval "$(cat "$tpl.tmp")"
		echo "DATA1=$(($(python3 "$POKE" get "$tpl.qcow2" \
			$((l1_0 + 8))) & MASK))" >>"$tpl.tmp"
		mv "$tpl.tmp" "$tpl.layout"
	fi
	newdir corrupt || return 1
	IMG=$PWD/c.qcow2
	cp "$tpl.qcow2" "$IMG" || return 1
	eval "$(cat "$tpl.layout")"
	[ "$cluster_size" = 4096 ] && [ "$l1_0" -gt 0 ] && [ "$l1_2" -gt 0 ] ||
		fail "unexpected layout" || return 1
	L2E1=$((l1_0 + 8))
}

poke() {
	must python3 "$POKE" put "$IMG" "$1" "$2"
}

# A checksum of the cluster at $1 (nothing when past the end of the file),
# and one of the image past its header cluster.
sums() {
	local size
	size=$(stat -c %s "$IMG")
	if [ "$1" -ge 0 ] && [ "$1" -lt "$size" ]; then
		dd if="$IMG" bs=4096 skip=$(($1 / 4096)) count=1 status=none |
			sha256sum | cut -c1-16
	else
		echo past-end
	fi
	tail -c +4097 "$IMG" | sha256sum | cut -c1-16
}

# io_fails read|write VOFF: one direct 4 KiB I/O at VOFF must fail with EIO.
io_fails() {
	local out
	if [ "$1" = read ]; then
		out=$(dd if="$WDEV" of=/dev/null bs=4096 count=1 \
			skip=$(($2 / 4096)) iflag=direct 2>&1)
	else
		out=$(dd if=/dev/zero of="$WDEV" bs=4096 count=1 \
			seek=$(($2 / 4096)) oflag=direct conv=notrunc 2>&1)
	fi && { fail "$1 at $2 succeeded"; return 1; }
	echo "$out" | grep -q 'Input/output error' ||
		fail "$1 at $2: not EIO: $out"
}

# mark: a kernel log marker; logged MSG: the kernel said "corrupt image:
# MSG" since the last mark.
mark() {
	MARK="t-corrupt: mark $$-$RANDOM"
	echo "$MARK" >/dev/kmsg
}
logged() {
	dmesg | sed -n "\|$MARK|,\$p" | grep -qF "corrupt image: $1" ||
		fail "no 'corrupt image: $1' in the log: $(dmesg | tail -n 3)"
}

# health corrupt, mode ro
safe_mode() {
	local mode health
	mode=$(dm_status_field c 1)
	health=$(dm_status_field c 8)
	[ "$mode" = ro ] && [ "$health" = corrupt ] ||
		fail "status: mode $mode, health $health: $(dmsetup status c)"
}

corrupt_bit() {
	echo $(($(hdr_byte "$IMG" 79) & 2))
}

# The good cluster 0 still reads its data (0x5a is "Z"); direct I/O, so
# that no readahead meets the bad entry.
good_read() {
	local n
	n=$(dd if="$WDEV" bs=4096 count=1 iflag=direct status=none |
		tr -d Z | wc -c)
	[ "$n" = 0 ] || fail "cluster 0 does not read back"
}

# io_case VOFF MSG BAD_OFF [v2] [loop]: the patched image is served
# read-only, then writable; each time the I/O at VOFF must fail with EIO
# and the target must go to its safe mode. BAD_OFF: where the bad pointer
# points (checksummed; -1 when outside the file). MSG may be empty when
# the case only requires "corrupt image".
io_case() {
	local voff=$1 msg=$2 bad=$3 v2='' loop='' opt before after whole
	shift 3
	for opt; do
		case $opt in
		v2) v2=1 ;;
		loop) loop=loop ;;
		esac
	done
	[ -z "$loop" ] || grow_for_loop "$IMG" || return 1
	before=$(sums "$bad")
	whole=$(sha256sum <"$IMG")

	# Read-only: EIO, safe mode, and the image is not touched at all
	mark
	wdev_create c "$IMG" $loop ro || return 1
	io_fails read "$voff" || return 1
	logged "$msg" || return 1
	safe_mode || return 1
	good_read || return 1
	wdev_remove c || return 1
	[ "$(sha256sum <"$IMG")" = "$whole" ] ||
		fail "a read-only device changed the image" || return 1

	# Writable: the write that meets the entry fails first
	mark
	wdev_create c "$IMG" $loop || return 1
	io_fails write "$voff" || return 1
	logged "$msg" || return 1
	safe_mode || return 1
	io_fails read "$voff" || return 1
	io_fails write $((8 << 20)) || return 1	# read-only from now on
	good_read || return 1
	wdev_remove c || return 1
	after=$(sums "$bad")
	[ "$before" = "$after" ] ||
		fail "bytes changed: $(echo "$before" | tr '\n' ' ')-> $(echo "$after" | tr '\n' ' ')" ||
		return 1
	if [ -n "$v2" ]; then
		# Version 2 has no feature bits: the header stays as it was
		[ "$(sha256sum <"$IMG")" = "$whole" ] ||
			fail "v2 image changed" || return 1
	else
		[ "$(corrupt_bit)" = 2 ] ||
			fail "corrupt bit not set in the header" || return 1
	fi
	# The corrupt bit keeps it from being written again
	if [ -z "$v2" ]; then
		expect_refused c2 "$IMG" "Image is marked corrupt" || return 1
	fi
}

# ---- L2 entries (guest cluster 1) -----------------------------------------

# A plain L2 entry cannot name the header: offset 0 means "unallocated".
# A compressed descriptor can: this one points at byte 512 of the header.
# Compressed offsets are checked against the metadata like any other.
# The header itself legitimately changes (the corrupt bit), so only the
# rest of the image is compared.
test_l2_at_header() {
	mk_image || return 1
	poke "$L2E1" $((COMPRESSED | 512)) || return 1
	io_case 4096 "overlaps the header" -1
}

# Detected at I/O time (L2 entry decode + overlap check).
test_l2_at_l1() {
	mk_image || return 1
	poke "$L2E1" $((COPIED | l1_off)) || return 1
	io_case 4096 "overlaps the L1 table" "$l1_off"
}

test_l2_at_reftable() {
	mk_image || return 1
	poke "$L2E1" $((COPIED | rt_off)) || return 1
	io_case 4096 "overlaps the refcount table" "$rt_off"
}

# A data cluster over a refcount block. Expected: corruption, and the
# refcount block never written (the target knows where the refcount
# blocks and L2 tables are, read-only tables included).
test_l2_at_refblock() {
	mk_image || return 1
	poke "$L2E1" $((COPIED | rb_0)) || return 1
	io_case 4096 "overlaps an L2 table or a refcount block" "$rb_0"
}

# A data cluster over another L2 table (B): detected like the above, so a
# COPIED entry is never written in place over L2 table B.
test_l2_at_other_l2() {
	mk_image || return 1
	poke "$L2E1" $((COPIED | l1_2)) || return 1
	io_case 4096 "overlaps an L2 table or a refcount block" "$l1_2"
}

test_l2_past_end() {
	mk_image || return 1
	poke "$L2E1" $((COPIED | 1 << 30)) || return 1
	io_case 4096 "offset past the end of the image" -1
}

# The loop device is a fixed size: just past its last cluster
test_l2_past_end_loop() {
	local end
	mk_image || return 1
	grow_for_loop "$IMG" || return 1
	end=$(stat -c %s "$IMG")
	poke "$L2E1" $((COPIED | (end + 4095) / 4096 * 4096)) || return 1
	io_case 4096 "offset past the end of the image" -1 loop
}

# Bits 56-61 are reserved in an L2 entry: an offset of 2^56 is refused
# as such.
test_l2_beyond_2_56() {
	mk_image || return 1
	poke "$L2E1" $((COPIED | 1 << 56)) || return 1
	io_case 4096 "L2 entry has reserved bits set" -1
}

# A compressed descriptor holds 58 offset bits with 4 KiB clusters.
test_l2_compressed_beyond_2_56() {
	mk_image || return 1
	poke "$L2E1" $((COMPRESSED | 1 << 57)) || return 1
	io_case 4096 "Compressed cluster offset beyond 2^56" -1
}

test_l2_unaligned() {
	mk_image || return 1
	poke "$L2E1" $((COPIED | (DATA1 + 512))) || return 1
	io_case 4096 "Data cluster offset not cluster aligned" "$DATA1"
}

test_l2_unaligned_loop() {
	mk_image || return 1
	poke "$L2E1" $((COPIED | (DATA1 + 512))) || return 1
	io_case 4096 "Data cluster offset not cluster aligned" "$DATA1" loop
}

test_l2_zero_flag_v2() {
	mk_image 0.10 || return 1
	poke "$L2E1" $((COPIED | DATA1 | 1)) || return 1
	io_case 4096 "Zero cluster flag in a version 2 image" "$DATA1" v2
}

# ---- L1 entries (guest offsets 0 to 2 MiB) -------------------------------

test_l1_at_l1() {
	mk_image || return 1
	poke "$l1_off" $((COPIED | l1_off)) || return 1
	io_case 4096 "overlaps the L1 table" "$l1_off"
}

test_l1_at_reftable() {
	mk_image || return 1
	poke "$l1_off" $((COPIED | rt_off)) || return 1
	io_case 4096 "overlaps the refcount table" "$rt_off"
}

test_l1_at_reftable_loop() {
	mk_image || return 1
	poke "$l1_off" $((COPIED | rt_off)) || return 1
	io_case 4096 "overlaps the refcount table" "$rt_off" loop
}

# An L2 table over the refcount block: its entries read as L2 entries.
# Expected: corruption, and the block never written through the L2
# slice. A writable table loads the refcount blocks and refuses an L2
# table and a refcount block in one cluster.
test_l1_at_refblock() {
	local whole
	mk_image || return 1
	poke "$l1_off" $((COPIED | rb_0)) || return 1
	whole=$(sha256sum <"$IMG")
	# A writable table knows the refcount blocks: refused at load
	DM_LEN=$(img_sectors "$IMG") expect_refused c "$IMG" \
		"Refcount block used twice, or at an L2 table" || return 1
	[ "$(sha256sum <"$IMG")" = "$whole" ] || fail "image changed"
}

test_l1_past_end() {
	mk_image || return 1
	poke "$l1_off" $((COPIED | 1 << 30)) || return 1
	io_case 4096 "offset past the end of the image" -1
}

test_l1_beyond_2_56() {
	mk_image || return 1
	poke "$l1_off" $((COPIED | 1 << 56 | l1_0)) || return 1
	io_case 4096 "L1 entry has reserved bits set" "$l1_0"
}

test_l1_unaligned() {
	mk_image || return 1
	poke "$l1_off" $((COPIED | (l1_0 + 512))) || return 1
	io_case 4096 "L2 table offset not cluster aligned" "$l1_0"
}

# ---- refcount table entries ------------------------------------------------

# refused_rw MSG: the refcount table is read only by a writable table:
# read-only activation works and reads the data; writable activation is
# refused at table load with MSG; the image is not touched.
refused_rw() {
	local whole
	whole=$(sha256sum <"$IMG")
	wdev_create c "$IMG" ro || return 1
	good_read || return 1
	qio -r -f raw -c "read -P 0xa5 4M 64k" "$WDEV" || return 1
	[ "$(dm_status_field c 8)" = ok ] || fail "health not ok" || return 1
	wdev_remove c || return 1
	DM_LEN=$(img_sectors "$IMG") expect_refused c "$IMG" "$1" || return 1
	[ "$(sha256sum <"$IMG")" = "$whole" ] || fail "image changed"
}

# An aligned offset 0 means "no block", so the header is named by an
# unaligned one inside it. Refused at table load (writable).
test_rt_at_header() {
	mk_image || return 1
	poke "$rt_off" 512 || return 1
	refused_rw "Refcount block offset not cluster aligned"
}

test_rt_at_l1() {
	mk_image || return 1
	poke "$rt_off" "$l1_off" || return 1
	refused_rw "Refcount block outside the image or over metadata"
}

test_rt_past_end() {
	mk_image || return 1
	poke "$rt_off" $((1 << 30)) || return 1
	refused_rw "Refcount block outside the image or over metadata"
}

# No refcount block for the first clusters, which hold the metadata: a
# cluster the target would take there is metadata. Loaded fine; the first
# allocating write must fail (EIO, corrupt) and write nothing.
test_rt_missing() {
	local before
	mk_image || return 1
	poke "$rt_off" 0 || return 1
	before=$(sums -1)
	mark
	wdev_create c "$IMG" || return 1
	io_fails write $((8 << 20)) || return 1
	logged "" || return 1
	safe_mode || return 1
	good_read || return 1
	wdev_remove c || return 1
	[ "$(sums -1)" = "$before" ] || fail "image changed past the header" ||
		return 1
	[ "$(corrupt_bit)" = 2 ] || fail "corrupt bit not set"
}

# A refcount block over L2 table A: its entries read as refcounts.
# Expected: refused, or the first allocating write fails (EIO, corrupt)
# without writing a refcount into the L2 table. Not detected today.
test_rt_at_l2() {
	local before
	mk_image || return 1
	poke "$rt_off" "$l1_0" || return 1
	before=$(sums "$l1_0")
	mark
	if ! wdev_create c "$IMG" 2>/dev/null; then
		dmesg | tail -n 5 | grep -q 'qcow2: ' ||
			fail "refused without a reason" || return 1
		log "refused at table load"
	else
		io_fails write $((8 << 20)) || { wdev_remove c; return 1; }
		logged "" || { wdev_remove c; return 1; }
		wdev_remove c || return 1
	fi
	[ "$(sums "$l1_0")" = "$before" ] ||
		fail "L2 table A or the image changed"
}

# Every entry of a 16-cluster refcount table (8192 entries) names the
# same refcount block. A writable table reads the refcount blocks at
# load; duplicates are no valid image's (each block is a cluster of its
# own), so the load must not read more than the image holds. Expected:
# refused, or loaded after reading at most twice the file through the
# loop device. Today every entry is read again, at load and again at
# resume: 64 MiB for a file of 216 KiB (and 4 TiB for an 8 MiB table
# naming one 2 MiB block, which keeps the load busy for hours), so this
# fails.
test_rt_duplicate_blocks() {
	local dev before after size
	mk_image || return 1
	size=$(stat -c %s "$IMG")
	must python3 - "$IMG" "$size" "$rb_0" <<'PY' || return 1
import struct, sys
img, size, rb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
off = (size + 4095) // 4096 * 4096
with open(img, "r+b") as f:
    f.seek(off)
    f.write(struct.pack(">Q", rb) * (16 * 4096 // 8))
    f.seek(48)
    f.write(struct.pack(">QI", off, 16))
PY
	size=$(stat -c %s "$IMG")
	dev=$(losetup -f --show "$IMG") || fail "losetup" || return 1
	before=$(awk '{print $3}' "/sys/block/${dev#/dev/}/stat")
	mark
	if timeout 120 dmsetup create c \
		--table "0 $(img_sectors "$IMG") qcow2 $dev" 2>/dev/null; then
		log "accepted"
		dm_remove c
	else
		dmesg | sed -n "\\|$MARK|,\$p" | grep -q 'qcow2: ' ||
			{ losetup -d "$dev"; fail "refused without a reason"; return 1; }
		log "refused: $(last_dm_error)"
	fi
	after=$(awk '{print $3}' "/sys/block/${dev#/dev/}/stat")
	losetup -d "$dev"
	log "table load read $(((after - before) / 2)) KiB of a $((size >> 10)) KiB image"
	[ $(((after - before) * 512)) -le $((2 * size)) ] ||
		fail "the table load read $(((after - before) * 512)) bytes"
}
