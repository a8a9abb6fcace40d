# shellcheck shell=bash
# Read path: images made by qemu-img and qemu-io read back identically
# through the target, with the image given as a file and as a loop device.

# fill_image IMG SEED: patterns at pseudo-random offsets, zeroed ranges
# (zero clusters on v3) and a discarded range, all through qemu-io.
fill_image() {
	local img=$1 size cmds=() i off len
	RANDOM=$2
	size=$(($(img_sectors "$img") * 512))
	for i in $(seq 1 24); do
		len=$(( (RANDOM % 512 + 1) * 512 ))
		off=$(( (RANDOM * 32768 + RANDOM) % ((size - len) / 512) * 512 ))
		cmds+=(-c "write -P $((i * 7 % 255 + 1)) $off $len")
	done
	for i in 1 2 3; do
		len=$(( (RANDOM % 8 + 1) * 65536 ))
		off=$(( (RANDOM * 32768 + RANDOM) % ((size - len) / 65536) * 65536 ))
		cmds+=(-c "write -z $off $len")
	done
	cmds+=(-c "discard $((size / 2)) 1M")
	qemu-io -f qcow2 "${cmds[@]}" "$img" >/dev/null
}

# check_dev NAME IMG REF: the device reads the same as the image, through
# qemu-img compare -U and through random direct reads of varied sizes.
check_dev() {
	local dev=/dev/mapper/$1
	must qemu-img compare -U -f raw -F qcow2 "$dev" "$2" || return 1
	must python3 "$QCOW2_TOP/tests/vm/randread.py" "$dev" "$3" 200 || return 1
	must dd if="$dev" of=/dev/null bs=1M iflag=direct || return 1
}

# check_both IMG: through the file backend, then a read-only loop device.
check_both() {
	local img=$PWD/$1 ref=$PWD/$1.raw loopdev
	must qemu-img check "$img" || return 1
	must qemu-img convert -O raw "$img" "$ref" || return 1
	dm_create rd-file "$img" --readonly || return 1
	check_dev rd-file "$img" "$ref" || return 1
	dm_remove rd-file || return 1
	loopdev=$(losetup -f --show -r "$img") || return 1
	DM_LEN=$(img_sectors "$img") dm_create rd-loop "$loopdev" --readonly ||
		return 1
	check_dev rd-loop "$img" "$ref" || return 1
	dm_remove rd-loop && losetup -d "$loopdev" && rm -f "$ref"
}

# read_case OPTIONS SIZE SEED
read_case() {
	rm -f img.qcow2
	must qemu-img create -f qcow2 -o "$1" img.qcow2 "$2" || return 1
	fill_image img.qcow2 "$3" || return 1
	check_both img.qcow2
}

test_v3_c512()	{ read_case compat=1.1,cluster_size=512 32M 1; }
test_v3_c4k()	{ read_case compat=1.1,cluster_size=4k 64M 2; }
test_v3_c64k()	{ read_case compat=1.1,cluster_size=64k 64M 3; }
test_v3_c2m()	{ read_case compat=1.1,cluster_size=2M 256M 4; }
test_v2_c512()	{ read_case compat=0.10,cluster_size=512 32M 5; }
test_v2_c4k()	{ read_case compat=0.10,cluster_size=4k 64M 6; }
test_v2_c64k()	{ read_case compat=0.10,cluster_size=64k 64M 7; }
test_v2_c2m()	{ read_case compat=0.10,cluster_size=2M 256M 8; }
test_refcount1()	{ read_case refcount_bits=1 64M 9; }
test_refcount64()	{ read_case refcount_bits=64 64M 10; }
test_c2m_refcount1()	{ read_case cluster_size=2M,refcount_bits=1 256M 11; }
test_lazy_refcounts()	{ read_case lazy_refcounts=on 64M 12; }
test_prealloc_metadata_v3()	{ read_case preallocation=metadata 64M 13; }
test_prealloc_metadata_v2()	{ read_case compat=0.10,preallocation=metadata 64M 14; }
test_prealloc_full()	{ read_case preallocation=full 64M 15; }
test_prealloc_falloc_c4k()	{ read_case cluster_size=4k,preallocation=falloc 32M 16; }

# Zero clusters that keep their host cluster (zero-alloc) and plain zero
# clusters must read as zeros although the host clusters hold data.
test_zero_alloc() {
	rm -f img.qcow2
	must qemu-img create -f qcow2 -o preallocation=metadata img.qcow2 16M ||
		return 1
	must qemu-io -f qcow2 -c "write -P 0x5a 0 16M" -c "write -z 1M 2M" \
		-c "write -z -u 8M 1M" -c "write -P 0x11 1536k 4k" img.qcow2 ||
		return 1
	qemu-img map -U --output=json img.qcow2 | grep -q '"zero": true, "data": false, "offset"' ||
		fail "no zero-alloc cluster in the test image" || return 1
	check_both img.qcow2
}

# A virtual size of 1 TiB with scattered clusters, one in each of 200 L2
# tables 5 GiB apart: reads are right, and the cache stays within its
# bound (64 slices here) while the reads touch 200 slices.
test_1tib_sparse() {
	local g=$((1 << 30)) o k cmds=() reads=() cache used max
	rm -f big.qcow2
	must qemu-img create -f qcow2 big.qcow2 1T || return 1
	for k in $(seq 0 199); do
		o=$((k * 5 * g + (k % 7) * 65536))
		cmds+=(-c "write -P $((k % 250 + 1)) $o 4k")
		reads+=(-c "read -P $((k % 250 + 1)) $o 4k" -c "read -P 0 $((o + 4096)) 60k")
	done
	cmds+=(-c "write -P 0xee $((1024 * g - 65536)) 64k")
	reads+=(-c "read -P 0xee $((1024 * g - 65536)) 64k")
	must qemu-io -f qcow2 "${cmds[@]}" big.qcow2 || return 1
	dm_create big "$PWD/big.qcow2 2 cache_size 256k" --readonly || return 1
	must qemu-io -r -f raw "${reads[@]}" /dev/mapper/big || return 1
	cache=$(dm_status_field big 4)
	used=${cache%/*}
	max=${cache#*/}
	log "cache $cache, misses $(dm_status_field big 6), evictions $(dm_status_field big 7)"
	[ "$max" -eq 262144 ] || fail "cache bound $max, want 262144" || return 1
	[ "$used" -le "$max" ] || fail "cache uses $used > $max" || return 1
	[ "$(dm_status_field big 7)" -gt 0 ] || fail "no evictions" || return 1
	dm_remove big
}

# Status fields and the table printed back as given.
test_status_and_table() {
	local len st
	rm -f img.qcow2
	must qemu-img create -f qcow2 img.qcow2 64M || return 1
	must qemu-io -f qcow2 -c "write -P 1 0 1M" img.qcow2 || return 1
	len=$(img_sectors img.qcow2)
	dm_create st "$PWD/img.qcow2 2 cache_size 1m" --readonly || return 1
	[ "$(dmsetup table st)" = "0 $len qcow2 $PWD/img.qcow2 2 cache_size 1m" ] ||
		fail "table: $(dmsetup table st)" || return 1
	dd if=/dev/mapper/st of=/dev/null bs=64k count=16 iflag=direct 2>/dev/null
	st=$(dmsetup status st)
	log "status: $st"
	set -- $st
	[ "$4" = ro ] || fail "mode $4" || return 1
	[ "$5" = "$len" ] || fail "virtual sectors $5" || return 1
	[ "$6" = 65536 ] || fail "cluster size $6" || return 1
	[ "${7#*/}" = 1048576 ] || fail "cache bound ${7#*/}" || return 1
	[ "$9" -ge 1 ] || fail "no cache miss counted" || return 1
	[ "$8" -ge 1 ] || fail "no cache hit counted" || return 1
	[ "${11}" = ok ] || fail "health ${11}" || return 1
	dm_remove st
}

# ---- large reads on a device just created --------------------------------------

# cold_case OPTS MIB: large direct reads, each on a device just created
# so that no slice is cached. A read that misses goes to a worker whole
# (within a group of clusters and 4 MiB), which serves it as one piece
# when its clusters continue each other in the image and through a buffer
# when they do not. The image has a compressed backing file, a run
# written in order (contiguous clusters), clusters written in random
# order, zero clusters and a discarded range; reads of 4 MiB, 1 MiB and
# 200 KiB start off the cluster grid.
cold_case() {
	local opts=$1 size=$(($2 << 20)) img=$PWD/cold.qcow2
	local base=$PWD/cold-base.qcow2 ref=$PWD/cold.raw bs skip
	rm -f "$img" "$base" "$ref" cold-src.raw
	# 4 KiB blocks, compressible (text naming the block) or random
	must python3 -c "import random
r = random.Random(7)
with open('cold-src.raw', 'wb') as f:
    for o in range(0, $size, 4096):
        f.write(b'%015x\\n' % o * 256 if r.random() < 0.8
                else r.randbytes(4096))" || return 1
	must qemu-img convert -c -f raw -O qcow2 cold-src.raw "$base" || return 1
	must qemu-img create -q -f qcow2 -o "$opts" -b "$base" -F qcow2 \
		"$img" "$size" || return 1
	must qemu-io -f qcow2 -c "write -P 0x11 0 $((size / 4))" "$img" ||
		return 1
	fill_image "$img" 31 || return 1
	must qemu-img check "$img" || return 1
	must qemu-img convert -O raw "$img" "$ref" || return 1
	for bs in 4M:0 1M:3584 200K:12800; do
		skip=${bs#*:} bs=${bs%:*}
		dm_create cold "$img 2 backing $base" --readonly || return 1
		must dd if=/dev/mapper/cold of=cold.out bs="$bs" skip="$skip" \
			iflag=direct,skip_bytes || return 1
		dm_remove cold || return 1
		cmp -s cold.out <(tail -c +$((skip + 1)) "$ref") ||
			fail "$bs reads from byte $skip differ from the image" ||
			return 1
	done
	rm -f "$img" "$base" "$ref" cold-src.raw cold.out
}
test_cold_c64k()	{ cold_case cluster_size=64k 32; }
test_cold_c512()	{ cold_case cluster_size=512 8; }
test_cold_c2m()		{ cold_case cluster_size=2M 64; }
test_cold_c64k_l2x()	{ cold_case cluster_size=64k,extended_l2=on 32; }
