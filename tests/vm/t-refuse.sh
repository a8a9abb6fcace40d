# shellcheck shell=bash
# Bad input is refused at table load with a message naming the problem,
# and nothing is left behind.

# Every malformed header made by tests/images/bad-headers.sh.
test_bad_headers() {
	local dir=$PWD/bad name msg bad=0 n=0
	rm -rf "$dir"
	must "$QCOW2_TOP/tests/images/bad-headers.sh" "$dir" || return 1
	while IFS=$'\t' read -r name msg; do
		n=$((n + 1))
		expect_refused "bad-$name" "$dir/$name.qcow2" "$msg" --readonly ||
			{ echo "  ($name)" >&2; bad=$((bad + 1)); }
	done <"$dir/expected.tsv"
	log "$n malformed headers tried, $bad not refused as expected"
	[ "$n" -ge 30 ] || fail "only $n cases" || return 1
	[ "$bad" -eq 0 ]
}

# Valid images using features this target does not serve yet.
test_unsupported_features() {
	local bad=0
	rm -f base.raw *.qcow2 data.raw
	truncate -s 16M base.raw
	must qemu-img create -q -f qcow2 -b "$PWD/base.raw" -F raw backed.qcow2 ||
		return 1
	must qemu-img create -q -f qcow2 -o data_file="$PWD/data.raw" ext.qcow2 16M ||
		return 1
	must qemu-img create -q -f qcow2 --object secret,id=s0,data=pw \
		-o encrypt.format=luks,encrypt.key-secret=s0 luks.qcow2 16M ||
		return 1
	# The kernel never opens a name found in an image: the table names it
	expect_refused u1 "$PWD/backed.qcow2" \
		"The image has a backing file: name it with the backing feature argument" \
		--readonly || bad=1
	expect_refused u4 "$PWD/ext.qcow2" \
		"Images with an external data file are not supported" --readonly || bad=1
	expect_refused u5 "$PWD/luks.qcow2" \
		"Encrypted images are not supported" --readonly || bad=1
	return $bad
}

# Tables that are wrong whatever the image.
test_bad_tables() {
	local img=$PWD/img.qcow2 len bad=0
	rm -f img.qcow2
	must qemu-img create -q -f qcow2 img.qcow2 16M || return 1
	len=$(img_sectors img.qcow2)
	DM_LEN=$((len + 1)) expect_refused t2 "$img" \
		"Device length exceeds the image's virtual size" --readonly || bad=1
	expect_refused t3 "$img 1 frobnicate" "Unknown feature argument" \
		--readonly || bad=1
	expect_refused t4 "$img 2 cache_size 0" \
		"Invalid cache_size (bytes, 1 to 4G)" --readonly || bad=1
	expect_refused t5 "$img 2 cache_size 12q" \
		"Invalid cache_size (bytes, 1 to 4G)" --readonly || bad=1
	expect_refused t6 "$img 3 cache_size" \
		"Invalid number of feature arguments" --readonly || bad=1
	expect_refused t7 "$img 1 cache_size" "cache_size needs a value" \
		--readonly || bad=1
	expect_refused t8 "$img 2 backing $img" \
		"The table names a backing image but the image has no backing file" \
		--readonly || bad=1
	expect_refused t9 "$img 2 snapshot 1" \
		"No snapshot with that id or name" --readonly || bad=1
	expect_refused t9b "$img 2 snapshot 1" \
		"A snapshot can only be activated read-only" || bad=1
	expect_refused t10 "$PWD/nonexistent.qcow2" "Cannot open image file" \
		--readonly || bad=1
	expect_refused t11 "$PWD" \
		"Image is neither a block device nor a regular file" --readonly || bad=1
	expect_refused t12 "$img 2 cache_size 1m extra" "Too many arguments" \
		--readonly || bad=1
	# A start other than 0: a two-target table
	if dmsetup create t13 --readonly --table "0 8 zero
8 8 qcow2 $img" 2>/dev/null; then
		dm_remove t13
		fail "start 8 accepted"; bad=1
	elif ! dmesg | tail -n 5 | grep -qF "qcow2: Target must start at sector 0"; then
		fail "start 8: $(last_dm_error)"; bad=1
	fi
	[ -z "$(dmsetup ls --target qcow2 | grep -v 'No devices')" ] ||
		fail "devices left behind" || bad=1
	return $bad
}

# The limits of a table: the longest legal feature list (eight backing
# images, cache_size and snapshot: 20 arguments) parses; a length that
# needs an L1 table beyond 32 MiB (2^32 entries and more, which once
# wrapped to 32 bits looked small) is refused rather than written into
# the header. (Device mapper itself refuses lengths past 2^63 bytes.)
test_table_limits() {
	local img=$PWD/lim.qcow2 args bad=0
	rm -f lim.qcow2
	must qemu-img create -q -f qcow2 lim.qcow2 16M || return 1
	args=$(printf ' cache_size 1m%.0s' $(seq 10))
	if DM_LEN=$(img_sectors "$img") dm_create lim "$img 20$args" --readonly; then
		dm_remove lim
	else
		fail "20 feature arguments: $(last_dm_error)"; bad=1
	fi
	DM_LEN=$((1 << 52)) expect_refused lim "$img 1 grow" \
		"Growing this much needs an L1 table over 32 MiB" || bad=1
	must qemu-img check -q "$img" || bad=1
	[ "$(img_sectors "$img")" -eq $((16 << 11)) ] ||
		fail "the image's size changed" || bad=1
	return $bad
}

# An image on a device of 4 KiB logical blocks: 2 KiB subclusters (64 KiB
# clusters, extended L2) cannot be written there alone, and are refused;
# 4 KiB ones (128 KiB clusters) are served: a write of one subcluster
# reads back, and the image checks clean.
test_subclusters_4k_sectors() {
	local loop bad=0
	rm -f sc4k.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=64k,extended_l2=on \
		sc4k.qcow2 16M && must truncate -s 64M sc4k.qcow2 || return 1
	loop=$(losetup -f --show --sector-size 4096 sc4k.qcow2) ||
		fail "losetup --sector-size 4096" || return 1
	DM_LEN=$((16 << 11)) expect_refused sc4k "$loop" \
		"Subcluster size smaller than the device's logical block size" ||
		bad=1
	losetup -d "$loop"
	must qemu-img create -q -f qcow2 -o cluster_size=128k,extended_l2=on \
		sc4k.qcow2 16M && must truncate -s 64M sc4k.qcow2 || return 1
	loop=$(losetup -f --show --sector-size 4096 sc4k.qcow2) ||
		fail "losetup --sector-size 4096" || return 1
	if DM_LEN=$((16 << 11)) dm_create sc4k "$loop"; then
		qemu-io -f raw -n -c "write -P 0x3c $((1 << 20 | 8192)) 4k" \
			-c "read -P 0x3c $((1 << 20 | 8192)) 4k" \
			-c "read -P 0 $((1 << 20)) 8k" /dev/mapper/sc4k >qio.out 2>&1
		grep -qiE 'fail|error' qio.out &&
			{ cat qio.out >&2; fail "4 KiB subcluster I/O"; bad=1; }
		dm_remove sc4k
	else
		fail "128 KiB clusters on 4 KiB sectors: $(last_dm_error)"; bad=1
	fi
	losetup -d "$loop"
	must qemu-img check -q sc4k.qcow2 || bad=1
	must qemu-io -f qcow2 -r -c "read -P 0x3c $((1 << 20 | 8192)) 4k" \
		sc4k.qcow2 || bad=1
	rm -f sc4k.qcow2 qio.out
	return $bad
}

# A hostile image whose refcount table names 200000 refcount blocks, each
# a distinct (empty) cluster of a sparse 25 GiB file (512-byte clusters:
# every block covers clusters below the end). Loading a writable table
# must not read them all: the image on a loop device, what the loop
# device read during dmsetup create stays under 16 MiB (reading every
# block took 198 MiB in 200000 reads); the device reads; the status
# shows the allocated count as unknown.
test_hostile_refcount_table() {
	local loop dev rd0 rd1 n=200000 bad=0
	rm -f ht.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=512 ht.qcow2 64M &&
		must truncate -s 25G ht.qcow2 || return 1
	python3 - ht.qcow2 "$n" <<'PY' || { fail "cannot patch"; return 1; }
import struct, sys
path, n = sys.argv[1], int(sys.argv[2])
table_off = 64 << 20                      # the new refcount table
with open(path, "r+b") as f:
    hdr = f.read(64)
    old_rt = struct.unpack(">Q", hdr[48:56])[0]
    f.seek(old_rt)
    first = f.read(8)                    # keeps the real first block
    ents = [first] + [struct.pack(">Q", (1 << 29) + i * 512)
                      for i in range(1, n)]
    f.seek(table_off)
    f.write(b"".join(ents))
    f.seek(48)
    f.write(struct.pack(">QI", table_off, (n * 8 + 511) // 512))
PY
	loop=$(losetup -f --show ht.qcow2) || fail "losetup" || return 1
	dev=${loop#/dev/}
	rd0=$(awk '{print $3}' "/sys/block/$dev/stat")
	if DM_LEN=$((64 << 11)) dm_create ht "$loop"; then
		rd1=$(awk '{print $3}' "/sys/block/$dev/stat")
		log "table load read $(((rd1 - rd0) / 2048)) MiB; allocated: $(dm_status_field ht 9)"
		[ $((rd1 - rd0)) -lt $((16 << 11)) ] ||
			fail "table load read $(((rd1 - rd0) / 2048)) MiB" || bad=1
		[ "$(dm_status_field ht 9)" = - ] ||
			fail "allocated $(dm_status_field ht 9), want -" || bad=1
		must dd if=/dev/mapper/ht of=/dev/null bs=1M count=4 \
			iflag=direct || bad=1
		dm_remove ht || bad=1
	else
		fail "the table did not load: $(last_dm_error)"; bad=1
	fi
	losetup -d "$loop"
	rm -f ht.qcow2
	return $bad
}
