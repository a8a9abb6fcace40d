# shellcheck shell=bash
# Features beyond plain clusters: compressed clusters (deflate, zstd),
# backing chains, discard, internal snapshot activation, messages. Images
# are made by qemu-img/qemu-io; what the device shows is compared with
# what QEMU reads from the same image, and after writes the image with
# what qemu-io made of a copy that got the same writes.

# The helpers of the write tests (wdev_create, qio, img_check, ...), not
# their cases.
# shellcheck source=tests/vm/t-write.sh
. "$QCOW2_TOP/tests/vm/t-write.sh"
for _fn in $(declare -F | awk '{print $3}' | grep '^test_'); do
	unset -f "$_fn"
done
unset _fn

# ---- compressed clusters ------------------------------------------------------

# zip_src RAW SIZE: compressible data (text, patterns) with some random
# (incompressible, so stored uncompressed by qemu-img) and zero ranges.
zip_src() {
	local raw=$1 size
	size=$(numfmt --from=iec "$2")
	must truncate -s "$size" "$raw" || return 1
	(cd /usr/share/doc && find . -type f -name '*copyright*' | sort |
		head -n 400 | xargs cat) 2>/dev/null | head -c $((size / 4)) |
		dd of="$raw" bs=64k seek=1 conv=notrunc status=none ||
		return 1
	head -c 1M /dev/urandom |
		dd of="$raw" bs=1M seek=$((size / 2 >> 20)) conv=notrunc \
			status=none || return 1
	qio -f raw -c "write -P 0x61 $((size * 3 / 4 + 512)) 300k" \
		-c "write -P 0x62 $((size - 8192)) 8192" "$raw"
}

img_compressed() {
	qemu-img check --output=json "$1" 2>/dev/null |
		python3 -c 'import json,sys; print(json.load(sys.stdin).get("compressed-clusters", 0))'
}

# zip_image IMG OPTS SIZE: IMG.raw and its compressed qcow2 copy IMG.
zip_image() {
	local img=$1 n
	zip_src "$img.raw" "$3" || return 1
	must qemu-img convert -c -O qcow2 -o "$2" "$img.raw" "$img" || return 1
	n=$(img_compressed "$img")
	log "$2: $n compressed clusters"
	[ "$n" -gt 0 ] || fail "qemu-img wrote no compressed cluster" || return 1
}

# zip_read_case OPTS SIZE: the device reads what qemu reads, through the
# file and the loop backends.
zip_read_case() {
	local img dev
	newdir zr || return 1
	img=$PWD/z.qcow2
	zip_image "$img" "$1" "$2" || return 1
	for backend in file loop; do
		if [ $backend = loop ]; then
			wdev_create zr "$img" ro loop || return 1
		else
			wdev_create zr "$img" ro || return 1
		fi
		dev=$WDEV
		must qemu-img compare -U -f raw -F raw "$img.raw" "$dev" ||
			return 1
		must python3 "$QCOW2_TOP/tests/vm/randread.py" "$dev" \
			"$img.raw" 100 262144 || return 1
		wdev_remove zr || return 1
	done
	cd .. && rm -rf zr
}

test_zip_deflate_c64k()	{ zip_read_case cluster_size=64k 32M; }
test_zip_deflate_c4k()	{ zip_read_case cluster_size=4k,compat=0.10 16M; }
test_zip_deflate_c2m()	{ zip_read_case cluster_size=2M 64M; }
test_zip_zstd_c64k()	{ zip_read_case cluster_size=64k,compression_type=zstd 32M; }
test_zip_zstd_c512()	{ zip_read_case cluster_size=512,compression_type=zstd 8M; }

# zip_write_case OPTS SIZE: writes over compressed clusters through the
# device and through qemu-io on a copy: identical images, both clean, no
# leak (the compressed data's refcounts are dropped).
zip_write_case() {
	local img size w=() p
	newdir zw || return 1
	img=$PWD/z.qcow2
	size=$(numfmt --from=iec "$2")
	zip_image "$img" "$1" "$2" || return 1
	must cp "$img" ref.qcow2 || return 1
	for p in 1 2 3 4 5 6 7 8; do
		w+=(-c "write -P $((p + 0x30)) $((size * p / 9 + p * 1536)) $((p * 3 * 1024 + 512))")
	done
	w+=(-c "write -P 0x77 65536 512")
	wdev_create zw "$img" || return 1
	qio -n -f raw "${w[@]}" "$WDEV" || return 1
	wdev_remove zw || return 1
	qio -f qcow2 "${w[@]}" ref.qcow2 || return 1
	img_check "$img" || return 1
	must qemu-img compare -U ref.qcow2 "$img" || return 1
	log "compressed clusters left: $(img_compressed "$img")"
	cd .. && rm -rf zw
}

test_zip_write_deflate()	{ zip_write_case cluster_size=64k 16M; }
test_zip_write_zstd_c4k()	{ zip_write_case cluster_size=4k,compression_type=zstd 16M; }

# The first compressed L2 entry of an image: "GUEST_OFFSET HOST_OFFSET".
first_compressed() {
	python3 - "$1" <<'EOF'
import struct, sys
f = open(sys.argv[1], 'rb')
h = f.read(104)
cb = struct.unpack('>I', h[20:24])[0]
l1_size, l1_off = struct.unpack('>IQ', h[36:48])
f.seek(l1_off)
l1 = struct.unpack('>%dQ' % l1_size, f.read(8 * l1_size))
per = (1 << cb) // 8
x = 62 - (cb - 8)
for i, e in enumerate(l1):
    l2 = e & 0x00fffffffffffe00
    if not l2:
        continue
    f.seek(l2)
    for j, ent in enumerate(struct.unpack('>%dQ' % per, f.read(1 << cb))):
        if ent & (1 << 62):
            print(((i * per + j) << cb), ent & ((1 << x) - 1))
            sys.exit(0)
sys.exit(1)
EOF
}

# Compressed data that does not decompress fails the read with EIO and
# says so; the rest of the device still reads.
zip_corrupt_case() {
	local img voff hoff cs
	newdir zc || return 1
	img=$PWD/z.qcow2
	zip_image "$img" "$1" 16M || return 1
	cs=$(img_cluster_size "$img")
	read -r voff hoff < <(first_compressed "$img") ||
		fail "no compressed entry found" || return 1
	printf '\377\377\377\377' |
		dd of="$img" bs=1 seek="$hoff" conv=notrunc status=none
	wdev_create zc "$img" ro || return 1
	dd if="$WDEV" of=/dev/null bs="$cs" skip=$((voff / cs)) count=1 \
		iflag=direct status=none 2>/dev/null &&
		fail "a corrupt compressed cluster read without error" &&
		return 1
	dmesg | tail -n 5 | grep -q 'corrupt compressed data' ||
		fail "no kernel message about the corrupt cluster" || return 1
	must dd if="$WDEV" of=/dev/null bs="$cs" count=1 iflag=direct ||
		return 1
	wdev_remove zc || return 1
	cd .. && rm -rf zc
}

test_zip_corrupt_deflate() {
	dm_only || return 0
	zip_corrupt_case cluster_size=64k
}

test_zip_corrupt_zstd() {
	dm_only || return 0
	zip_corrupt_case cluster_size=64k,compression_type=zstd
}

# ---- backing chains -------------------------------------------------------------

# chain_images: base.raw (24 MiB), mid.qcow2 (32 MiB, backed by the raw
# base) and top.qcow2 (48 MiB, backed by mid), each with its own writes,
# some over the others' and some past the shorter images' ends.
chain_images() {
	must truncate -s 24M base.raw || return 1
	qio -f raw -c "write -P 0x11 0 24M" -c "write -P 0x12 1M 77k" \
		-c "write -z 5M 1M" base.raw || return 1
	must qemu-img create -q -f qcow2 -b "$PWD/base.raw" -F raw \
		-o cluster_size=4k mid.qcow2 32M || return 1
	qio -f qcow2 -c "write -P 0x21 2M 1M" -c "write -P 0x22 23M 2M" \
		-c "write -P 0x23 30M 7k" -c "write -z 4M 64k" mid.qcow2 ||
		return 1
	must qemu-img create -q -f qcow2 -b "$PWD/mid.qcow2" -F qcow2 \
		top.qcow2 48M || return 1
	qio -f qcow2 -c "write -P 0x31 2560k 128k" -c "write -P 0x32 40M 1M" \
		-c "write -z 8M 64k" top.qcow2
}

# chain_writes: partial clusters over data of each layer, over zeros,
# across the end of each lower layer.
chain_writes() {
	local o
	for o in 4096 $((1 << 20)) $((2 << 20)) $((5 << 20)) $((8 << 20)) \
		 $((24 << 20)) $((30 << 20)) $((32 << 20)); do
		echo "-c"
		echo "write -P $(((o >> 12) % 200 + 40)) $((o - 1536)) 3584"
	done
}

# A raw base (as a loop device), a qcow2 middle (file) and a qcow2 top:
# the device reads what qemu reads, writes land in the top only and
# match qemu's, and the lower images do not change.
test_chain_three_deep() {
	local base sums w=()
	newdir ch || return 1
	chain_images || return 1
	mapfile -t w < <(chain_writes)
	must qemu-img convert -O raw top.qcow2 ref.raw || return 1
	sums=$(sha256sum base.raw mid.qcow2)
	base=$(losetup -f --show -r base.raw) || fail "losetup" || return 1

	DM_LEN=$(img_sectors top.qcow2) dm_create ch \
		"$PWD/top.qcow2 4 backing $PWD/mid.qcow2 backing $base" ||
		{ losetup -d "$base"; return 1; }
	must qemu-img compare -U -f raw -F raw ref.raw /dev/mapper/ch &&
		must python3 "$QCOW2_TOP/tests/vm/randread.py" /dev/mapper/ch \
			ref.raw 100 262144 || { dm_remove ch; losetup -d "$base"
						return 1; }
	log "reads match qemu through the chain"
	must cp top.qcow2 ref.qcow2 || return 1
	qio -n -f raw "${w[@]}" /dev/mapper/ch
	local rc=$?
	dm_remove ch || return 1
	losetup -d "$base"
	[ $rc = 0 ] || return 1
	qio -f qcow2 "${w[@]}" ref.qcow2 || return 1
	img_check top.qcow2 || return 1
	must qemu-img compare -U ref.qcow2 top.qcow2 || return 1
	[ "$(sha256sum base.raw mid.qcow2)" = "$sums" ] ||
		fail "a backing image changed" || return 1
	cd .. && rm -rf ch
}

# The table must name exactly the chain the headers declare.
test_chain_mismatch_refused() {
	local len
	dm_only || return 0
	newdir cm || return 1
	chain_images || return 1
	must qemu-img create -q -f qcow2 plain.qcow2 48M || return 1
	len=$(img_sectors top.qcow2)
	export DM_LEN=$len
	expect_refused cm "$PWD/top.qcow2" \
		"The image has a backing file: name it with the backing feature argument" ||
		return 1
	expect_refused cm "$PWD/top.qcow2 2 backing $PWD/mid.qcow2" \
		"A backing image has a backing file that the table does not name" ||
		return 1
	expect_refused cm "$PWD/top.qcow2 6 backing $PWD/mid.qcow2 backing $PWD/base.raw backing $PWD/base.raw" \
		"The table names more backing images than the chain has" ||
		return 1
	expect_refused cm "$PWD/plain.qcow2 2 backing $PWD/mid.qcow2" \
		"The table names a backing image but the image has no backing file" ||
		return 1
	expect_refused cm "$PWD/top.qcow2 2 backing $PWD/nonexistent" \
		"Cannot open image file" || return 1
	unset DM_LEN
	cd .. && rm -rf cm
}

# ---- discard ------------------------------------------------------------------

# blkdiscard over whole and partial clusters, with and without a backing
# file: the image is what qemu-io's discard makes of a copy (whole clusters
# unallocated, or zero clusters over a backing file; partial ones kept),
# clean, with no leak; the freed space is written again.
discard_case() {
	local backing=$1 img dev size w=() d=() a0 a1 dm_args
	newdir dc || return 1
	img=$PWD/d.qcow2
	if [ -n "$backing" ]; then
		must truncate -s 16M base.raw || return 1
		qio -f raw -c "write -P 0x44 0 16M" base.raw || return 1
		must qemu-img create -q -f qcow2 -b "$PWD/base.raw" -F raw \
			"$img" 16M || return 1
		dm_args="$img 2 backing $PWD/base.raw"
	else
		must qemu-img create -q -f qcow2 "$img" 16M || return 1
		dm_args=$img
	fi
	size=$((16 << 20))
	w=(-c "write -P 0x55 0 12M" -c "write -P 0x56 $((12 << 20)) 64k")
	d=(-c "discard $((1 << 20)) $((3 << 20))"
	   -c "discard $((5 << 20 + 4096)) $((2 << 20))"
	   -c "discard $((12 << 20)) 64k")
	must cp "$img" ref.qcow2 || return 1
	qio -f qcow2 "${w[@]}" "${d[@]}" ref.qcow2 || return 1

	DM_LEN=$((size / 512)) dm_create dc "$dm_args" || return 1
	dev=/dev/mapper/dc
	qio -n -f raw "${w[@]}" "$dev" || return 1
	must fsync_path "$dev" || return 1
	a0=$(dm_status_field dc 9)
	must blkdiscard -o $((1 << 20)) -l $((3 << 20)) "$dev" &&
		must blkdiscard -o $((5 << 20 + 4096)) -l $((2 << 20)) "$dev" &&
		must blkdiscard -o $((12 << 20)) -l 65536 "$dev" || return 1
	must fsync_path "$dev" || return 1
	# A second flush writes the refcount decreases the first one allowed
	must dmsetup message dc 0 flush || return 1
	a1=$(dm_status_field dc 9)
	log "allocated clusters: $a0 before the discards, $a1 after"
	# 48 + 31 + 1 whole clusters
	[ -n "$backing" ] || [ "$a1" -le $((a0 - 80)) ] ||
		fail "discards freed $((a0 - a1)) clusters, want >= 80" ||
		return 1
	dm_remove dc || return 1
	img_check "$img" || return 1
	must qemu-img compare -U ref.qcow2 "$img" || return 1

	# Space freed is used again: rewriting the range does not grow the file
	local sz0 sz1
	sz0=$(stat -c %s "$img")
	DM_LEN=$((size / 512)) dm_create dc "$dm_args" || return 1
	qio -n -f raw -c "write -P 0x57 $((1 << 20)) 3M" "$dev" || return 1
	dm_remove dc || return 1
	sz1=$(stat -c %s "$img")
	log "image file: $sz0 bytes, $sz1 after rewriting 3 MiB"
	[ "$sz1" -le "$sz0" ] || fail "freed clusters were not reused" ||
		return 1
	img_check "$img" || return 1
	qio -f qcow2 -c "write -P 0x57 $((1 << 20)) 3M" ref.qcow2 || return 1
	must qemu-img compare -U ref.qcow2 "$img" || return 1
	cd .. && rm -rf dc
}

test_discard_plain()	{ dm_only || return 0; discard_case ""; }
test_discard_backing()	{ dm_only || return 0; discard_case backing; }

# fstrim on a full file system frees clusters; files written afterwards
# reuse them; the file system and the image stay clean.
test_discard_fstrim() {
	local img mnt=$SCRATCH/mnt a0 a1 sz0 sz1
	dm_only || return 0
	newdir ft || return 1
	img=$PWD/f.qcow2
	must qemu-img create -q -f qcow2 "$img" 128M || return 1
	dm_create ft "$img" || return 1
	must mkfs.ext4 -q -E nodiscard /dev/mapper/ft || return 1
	mkdir -p "$mnt"
	must mount -o nodiscard /dev/mapper/ft "$mnt" || return 1
	must dd if=/dev/urandom of="$mnt/fill" bs=1M count=80 conv=fsync ||
		return 1
	a0=$(dm_status_field ft 9)
	must rm "$mnt/fill" && sync || return 1
	must fstrim "$mnt" || return 1
	must fsync_path /dev/mapper/ft && must dmsetup message ft 0 flush ||
		return 1
	a1=$(dm_status_field ft 9)
	log "allocated clusters: $a0 full, $a1 after fstrim"
	[ "$a1" -le $((a0 - 1000)) ] ||
		fail "fstrim freed $((a0 - a1)) clusters" || return 1
	sz0=$(stat -c %s "$img")
	must dd if=/dev/urandom of="$mnt/again" bs=1M count=60 conv=fsync ||
		return 1
	sz1=$(stat -c %s "$img")
	log "image file: $sz0 bytes after fstrim, $sz1 after 60 MiB more"
	[ "$sz1" -le "$sz0" ] || fail "freed clusters were not reused" ||
		return 1
	must umount "$mnt" || return 1
	dm_remove ft || return 1
	img_check "$img" || return 1
	# e2fsck reads a raw copy
	must qemu-img convert -O raw "$img" fs.raw && must e2fsck -fn fs.raw ||
		return 1
	cd .. && rm -rf ft
}

# ---- write zeroes -------------------------------------------------------------

# zero_data IMG START LEN: bytes of [START, START + LEN) that qemu-img map
# reports as data (not zero clusters).
zero_data() {
	qemu-img map -U --output=json "$1" | python3 -c '
import json, sys
s, n = int(sys.argv[1]), int(sys.argv[2])
t = 0
for e in json.load(sys.stdin):
    lo, hi = max(s, e["start"]), min(s + n, e["start"] + e["length"])
    if hi > lo and e["data"]:
        t += hi - lo
print(t)' "$2" "$3"
}

# wz_case OPTS [backing]: write-zeroes requests (fallocate punch-hole,
# i.e. may unmap; zero-range and BLKZEROOUT, i.e. keep the allocation)
# over whole and partial clusters, over data and over a backing file: the
# image reads as a copy that got qemu-io's "write -z [-u]" at the same
# places, checks clean, and on v3 whole clusters became zero clusters,
# their space freed where unmapping was allowed.
wz_case() {
	local opts=$1 backing='' img dev a0 a1 tbl blk w=() z=()
	newdir wz || return 1
	[ "${2:-}" != backing ] || backing=$PWD/base.raw
	img=$PWD/w.qcow2
	if [ -n "$backing" ]; then
		must truncate -s 16M base.raw || return 1
		qio -f raw -c "write -P 0x66 0 16M" base.raw || return 1
	fi
	must qemu-img create -q -f qcow2 -o "$opts" \
		${backing:+-b "$backing" -F raw} "$img" 16M || return 1
	w=(-c "write -P 0x65 0 10M")
	z=(-c "write -z -u 1M 1M" -c "write -z 3M 512k"
	   -c "write -z -u $((5 << 20 | 1536)) 100k"
	   -c "write -z $((7 << 20 | 3584)) 70k"
	   -c "write -z -u 11M 2M" -c "write -z $((14 << 20)) 4k")
	must cp "$img" ref.qcow2 || return 1
	qio -f qcow2 "${w[@]}" "${z[@]}" ref.qcow2 || return 1

	tbl=$img${backing:+ 2 backing $backing}
	DM_LEN=$((16 << 11)) dm_create wz "$tbl" || return 1
	dev=/dev/mapper/wz
	blk=$(dmsetup info -c --noheadings -o blkdevname wz)
	[ "$(cat "/sys/block/$blk/queue/write_zeroes_max_bytes")" -gt 0 ] ||
		fail "no write-zeroes support advertised" || return 1
	qio -n -f raw "${w[@]}" "$dev" || return 1
	must fsync_path "$dev" || return 1
	a0=$(dm_status_field wz 9)
	must fallocate -p -o 1M -l 1M "$dev" &&
		must fallocate -z -o 3M -l 512k "$dev" &&
		must fallocate -p -o $((5 << 20 | 1536)) -l 100k "$dev" &&
		must blkdiscard -z -o $((7 << 20 | 3584)) -l 70k "$dev" &&
		must fallocate -p -o 11M -l 2M "$dev" &&
		must fallocate -z -o $((14 << 20)) -l 4k "$dev" || return 1
	must fsync_path "$dev" || return 1
	must dmsetup message wz 0 flush || return 1
	a1=$(dm_status_field wz 9)
	log "allocated clusters: $a0 before, $a1 after"
	dm_remove wz || return 1
	img_check "$img" || return 1
	must qemu-img compare -U ref.qcow2 "$img" || return 1
	case $opts in
	*compat=0.10*) ;;
	*)
		[ "$(zero_data "$img" $((1 << 20)) $((1 << 20)))" = 0 ] &&
			[ "$(zero_data "$img" $((3 << 20)) $((512 << 10)))" = 0 ] ||
			fail "whole clusters still map data" || return 1
		[ -n "$backing" ] || [ "$a1" -lt "$a0" ] ||
			fail "no cluster freed by the unmapping requests" ||
			return 1
		;;
	esac
	cd .. && rm -rf wz
}

test_wz_v3()		{ dm_only || return 0; wz_case cluster_size=64k; }
test_wz_v2()		{ dm_only || return 0; wz_case compat=0.10,cluster_size=4k; }
test_wz_backing()	{ dm_only || return 0; wz_case cluster_size=64k backing; }
test_wz_extl2()		{ dm_only || return 0; wz_case extended_l2=on,cluster_size=64k backing; }

# ---- subclusters (extended L2 entries) -------------------------------------

# sc_image IMG OPTS SIZE [BACKING]: an extended-L2 image with allocated,
# zero and unallocated subclusters side by side, made by qemu-io: partial
# subcluster writes, zero writes inside allocated clusters, a subcluster
# discard, whole clusters. BACKING: a raw backing file.
sc_image() {
	local img=$1 opts=$2 size=$3 backing=${4:-}
	must qemu-img create -q -f qcow2 -o "extended_l2=on,$opts" \
		${backing:+-b "$backing" -F raw} "$img" "$size" || return 1
	qio -f qcow2 -c "write -P 0x41 3k 5k" -c "write -P 0x42 64k 64k" \
		-c "write -z 130k 6k" -c "write -P 0x43 200k 1k" \
		-c "write -P 0x44 1M 300k" -c "write -z 1100k 12k" \
		-c "discard 1500k 1k" -c "write -z -u 2M 128k" \
		-c "write -P 0x45 6M 512" "$img"
}

# sc_writes: direct writes over every kind of subcluster: inside one,
# across states, across clusters, over zeros, over the backing file.
sc_writes() {
	local o k
	for o in 512:1k 2560:3k 7k:10k 60k:8k 129k:9k 199k:3k 1090k:40k \
		 1499k:3k 2040k:100k 3072k:512 4100k:64k; do
		k=${o%%[k:]*}
		echo "-c"
		echo "write -P $((k % 200 + 30)) ${o%:*} ${o#*:}"
	done
}

# sc_case OPTS [backing] [loop]: the device reads what qemu reads; writes
# through it match the same writes made by qemu-io; fio verifies mixed
# sizes over partly allocated clusters; the image checks clean.
sc_case() {
	local opts=$1 backing='' loop='' a img w=() tbl
	shift
	newdir sc || return 1
	for a; do
		case $a in
		backing) backing=$PWD/base.raw ;;
		loop) loop=loop ;;
		esac
	done
	img=$PWD/s.qcow2
	if [ -n "$backing" ]; then
		must truncate -s 8M base.raw || return 1
		qio -f raw -c "write -P 0x19 0 8M" -c "write -P 0x1a 1M 64k" \
			base.raw || return 1
	fi
	sc_image "$img" "$opts" 8M "$backing" || return 1
	mapfile -t w < <(sc_writes)
	must qemu-img convert -O raw "$img" ref.raw || return 1
	must cp "$img" ref.qcow2 || return 1
	[ -z "$loop" ] || grow_for_loop "$img" || return 1
	tbl=$img
	if [ -n "$loop" ]; then
		tbl=$(losetup -f --show "$img") || fail "losetup" || return 1
	fi
	DM_LEN=$(img_sectors ref.qcow2) dm_create sc \
		"$tbl${backing:+ 2 backing $backing}" || return 1
	must qemu-img compare -U -f raw -F raw ref.raw /dev/mapper/sc &&
		must python3 "$QCOW2_TOP/tests/vm/randread.py" /dev/mapper/sc \
			ref.raw 100 65536 || { dm_remove sc; return 1; }
	log "reads match qemu"
	qio -n -f raw "${w[@]}" /dev/mapper/sc || { dm_remove sc; return 1; }
	dm_remove sc || return 1
	[ -z "$loop" ] || losetup -d "$tbl"
	qio -f qcow2 "${w[@]}" ref.qcow2 || return 1
	img_check "$img" || return 1
	must qemu-img compare -U ref.qcow2 "$img" || return 1
	log "writes match qemu's"

	# Concurrent mixed-size writes inside partly allocated clusters
	must qemu-img create -q -f qcow2 -o "extended_l2=on,$opts" \
		${backing:+-b "$backing" -F raw} f.qcow2 8M || return 1
	qio -f qcow2 -c "write -P 0x51 0 8M" -c "write -z 2M 2M" \
		-c "discard 5M 1M" f.qcow2 || return 1
	DM_LEN=$(img_sectors f.qcow2) dm_create sc \
		"$PWD/f.qcow2${backing:+ 2 backing $backing}" || return 1
	must fio --filename=/dev/mapper/sc --direct=1 --ioengine=libaio \
		--iodepth=16 --bssplit=512/30:1536/10:4k/30:7k/10:64k/20 \
		--blockalign=512 --verify=crc32c --do_verify=1 \
		--verify_fatal=1 --name=sc --rw=randwrite --size=8M \
		--io_size=6M || { dm_remove sc; return 1; }
	dump_dev /dev/mapper/sc post.raw || { dm_remove sc; return 1; }
	dm_remove sc || return 1
	img_check f.qcow2 || return 1
	must qemu-img compare -U -f raw -F qcow2 post.raw f.qcow2 || return 1
	cd .. && rm -rf sc
}

# sc_write_like_qemu NAME IMG [RAW]: sc_writes through the device over
# IMG (which first reads as RAW, if given) and through qemu-io on a copy;
# IMG checks clean and reads as the copy.
sc_write_like_qemu() {
	local name=$1 img=$2 raw=${3:-} w=()
	mapfile -t w < <(sc_writes)
	must cp "$img" ref.qcow2 || return 1
	wdev_create "$name" "$img" || return 1
	if [ -n "$raw" ]; then
		must qemu-img compare -U -f raw -F raw "$raw" "$WDEV" || return 1
	fi
	qio -n -f raw "${w[@]}" "$WDEV" || return 1
	wdev_remove "$name" || return 1
	qio -f qcow2 "${w[@]}" ref.qcow2 || return 1
	img_check "$img" || return 1
	must qemu-img compare -U ref.qcow2 "$img"
}

test_sc_c64k()		{ sc_case cluster_size=64k; }
test_sc_c16k_loop()	{ dm_only || return 0; sc_case cluster_size=16k loop; }
test_sc_c32k_backing()	{ dm_only || return 0; sc_case cluster_size=32k backing; }
test_sc_c2m_backing()	{ dm_only || return 0; sc_case cluster_size=2M backing; }

# Subclusters of clusters shared with an internal snapshot: writes copy
# the cluster; the snapshot reads as before.
test_sc_snapshot() {
	local img
	newdir scs || return 1
	img=$PWD/s.qcow2
	sc_image "$img" cluster_size=64k 8M || return 1
	must qemu-img convert -O raw "$img" pre.raw || return 1
	must qemu-img snapshot -c s1 "$img" || return 1
	sc_write_like_qemu scs "$img" || return 1
	must qemu-img snapshot -a s1 "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 pre.raw "$img" || return 1
	cd .. && rm -rf scs
}

# A compressed extended-L2 image: reads, and writes that move clusters.
test_sc_compressed() {
	local img
	newdir scz || return 1
	img=$PWD/z.qcow2
	zip_image "$img" extended_l2=on,cluster_size=64k 8M || return 1
	sc_write_like_qemu scz "$img" "$img.raw" || return 1
	cd .. && rm -rf scz
}

# A subcluster both allocated and zero is corruption: that read fails,
# the image is marked corrupt, the rest of the device still reads.
test_sc_corrupt_bitmap() {
	local img
	dm_only || return 0
	newdir scc || return 1
	img=$PWD/s.qcow2
	sc_image "$img" cluster_size=64k 8M || return 1
	# Guest cluster 0: subcluster 1 (3k..4k is data) also zero
	python3 - "$img" <<'EOF' || fail "cannot patch" || return 1
import struct, sys
f = open(sys.argv[1], 'r+b')
h = f.read(104)
l1_off = struct.unpack('>Q', h[40:48])[0]
f.seek(l1_off)
l2 = struct.unpack('>Q', f.read(8))[0] & 0x00fffffffffffe00
f.seek(l2 + 8)
bmp = struct.unpack('>Q', f.read(8))[0]
assert bmp & 2, hex(bmp)
f.seek(l2 + 8)
f.write(struct.pack('>Q', bmp | (2 << 32)))
EOF
	wdev_create scc "$img" || return 1
	dd if="$WDEV" of=/dev/null bs=4k count=1 iflag=direct status=none \
		2>/dev/null && fail "a corrupt bitmap read without error" &&
		return 1
	dmesg | tail -n 5 | grep -q 'Subcluster both allocated and zero' ||
		fail "no kernel message naming the bitmap" || return 1
	must dd if="$WDEV" of=/dev/null bs=64k skip=1 count=1 iflag=direct ||
		return 1
	wdev_remove scc || return 1
	qemu-img check "$img" >/dev/null 2>&1 &&
		fail "qemu-img check found no corruption" && return 1
	[ $(($(hdr_byte "$img" 79) & 2)) -ne 0 ] ||
		fail "corrupt bit not set" || return 1
	cd .. && rm -rf scc
}

# ---- internal snapshots ---------------------------------------------------------

# A snapshot activated read-only (by name and by id) reads what qemu reads
# from it, while the active image has changed since; writable activation
# and unknown snapshots are refused.
test_snapshot_activate() {
	local img
	newdir sn || return 1
	img=$PWD/s.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 32M ||
		return 1
	qio -f qcow2 -c "write -P 0x61 0 3M" -c "write -P 0x62 20M 1M" \
		"$img" || return 1
	must qemu-img snapshot -c first "$img" || return 1
	qio -f qcow2 -c "write -P 0x71 1M 4M" -c "write -z 20M 64k" \
		-c "write -P 0x72 30M 1M" "$img" || return 1
	must qemu-img snapshot -c second "$img" || return 1
	qio -f qcow2 -c "write -P 0x81 0 1M" "$img" || return 1
	must qemu-img convert -O raw -l snapshot.name=first "$img" first.raw &&
		must qemu-img convert -O raw -l snapshot.name=second "$img" \
			second.raw || return 1

	dm_create sn "$img 2 snapshot first" --readonly || return 1
	must qemu-img compare -U -f raw -F raw first.raw /dev/mapper/sn ||
		return 1
	dm_remove sn || return 1
	dm_create sn "$img 2 snapshot 2" --readonly || return 1
	must qemu-img compare -U -f raw -F raw second.raw /dev/mapper/sn ||
		return 1
	dm_remove sn || return 1
	log "snapshots 'first' and id 2 read back as qemu reads them"

	# A name that is a later snapshot's id: the id wins, as in QEMU, with
	# that snapshot's own size (id 3 is named "4" and is 32M; id 4 is 48M)
	must qemu-img snapshot -c 4 "$img" && must qemu-img resize -q "$img" 48M &&
		qio -f qcow2 -c "write -P 0x91 40M 1M" -c "write -P 0x92 0 64k" \
			"$img" && must qemu-img snapshot -c fourth "$img" || return 1
	must qemu-img convert -O raw -l 4 "$img" four.raw &&
		must qemu-img convert -O raw -l snapshot.name=4 "$img" named4.raw ||
		return 1
	[ "$(stat -c %s four.raw)" = $((48 << 20)) ] &&
		! cmp -s four.raw named4.raw || fail "qemu-img: -l 4 is not id 4" ||
		return 1
	DM_LEN=$((48 << 11)) dm_create sn "$img 2 snapshot 4" --readonly ||
		return 1
	must qemu-img compare -U -f raw -F raw four.raw /dev/mapper/sn ||
		return 1
	dm_remove sn || return 1
	if dm_only 2>/dev/null; then
		must "$QCOW2_TOP/scripts/qcow2-dmsetup" create sn "$img" \
			--snapshot 4 >/dev/null || return 1
		[ "$(blockdev --getsize64 /dev/mapper/sn)" = $((48 << 20)) ] ||
			fail "qcow2-dmsetup: snapshot 4 is $(blockdev --getsize64 /dev/mapper/sn) bytes" ||
			return 1
		must qemu-img compare -U -f raw -F raw four.raw /dev/mapper/sn ||
			return 1
		dm_remove sn || return 1
	fi
	log "snapshot '4' is id 4, not the snapshot named 4, as qemu reads it"

	dm_only || { cd .. && rm -rf sn; return 0; }
	DM_LEN=$(img_sectors "$img") expect_refused sn "$img 2 snapshot first" \
		"A snapshot can only be activated read-only" || return 1
	DM_LEN=$(img_sectors "$img") expect_refused sn "$img 2 snapshot nosuch" \
		"No snapshot with that id or name" --readonly || return 1
	img_check "$img" || return 1
	cd .. && rm -rf sn
}

# ---- messages ---------------------------------------------------------------------

# flush writes back the dirty slices; cache_size changes the bound shown in
# the status (and lowers what is in use); anything else is refused.
test_messages() {
	local img
	dm_only || return 0
	newdir ms || return 1
	img=$PWD/m.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 1G ||
		return 1
	dm_create ms "$img" || return 1
	# Writes all over: many L2 slices cached, some dirty
	must fio --name=w --filename=/dev/mapper/ms --direct=1 --rw=randwrite \
		--bs=4k --size=1G --io_size=8M --randrepeat=1 || return 1
	[ "$(dm_status_field ms 10)" -gt 0 ] || fail "no dirty slices" ||
		return 1
	must dmsetup message ms 0 flush || return 1
	[ "$(dm_status_field ms 10)" = 0 ] ||
		fail "$(dm_status_field ms 10) dirty slices after flush" ||
		return 1
	log "cache before: $(dm_status_field ms 4)"
	must dmsetup message ms 0 cache_size 256k || return 1
	log "cache after cache_size 256k: $(dm_status_field ms 4)"
	[ "$(dm_status_field ms 4)" = 262144/262144 ] ||
		fail "cache $(dm_status_field ms 4), want 262144/262144" ||
		return 1
	must dmsetup message ms 0 cache_size 8m || return 1
	[ "$(dm_status_field ms 4 | cut -d/ -f2)" = 8388608 ] ||
		fail "cache bound not raised" || return 1
	dmsetup message ms 0 cache_size 0 2>/dev/null &&
		fail "cache_size 0 accepted" && return 1
	# No corruption met
	[ "$(dmsetup message ms 0 stats)" = "corruptions 0" ] ||
		fail "stats: '$(dmsetup message ms 0 stats)'" || return 1
	dmsetup message ms 0 frobnicate 2>/dev/null &&
		fail "an unknown message was accepted" && return 1
	dmesg | tail -n 3 | grep -q 'unrecognised message frobnicate' ||
		fail "no log line for the unknown message" || return 1
	dm_remove ms || return 1
	img_check "$img" || return 1
	cd .. && rm -rf ms
}

# ---- online grow ----------------------------------------------------------------

# A table reload with a larger length and the grow feature argument grows
# the image at resume; data on both sides of the old end is kept, qemu
# sees the new size. A larger length without "grow" is refused and leaves
# the image as it was (the table before it stays live); so is growing a
# read-only table, or past what the L1 table's clusters can map.
test_grow() {
	local img sum
	dm_only || return 0
	newdir gr || return 1
	img=$PWD/g.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	dm_create gr "$img" || return 1
	qio -n -f raw -c "write -P 0x41 $((64 * 1048576 - 8192)) 8192" \
		/dev/mapper/gr || return 1
	must dmsetup message gr 0 flush || return 1
	sum=$(md5sum <"$img")
	dmsetup load gr --table "0 $((256 << 11)) qcow2 $img" 2>/dev/null &&
		fail "a longer table without grow was loaded" && return 1
	dmesg | tail -n 5 | grep -qF "needs the grow argument" ||
		fail "refusal without grow: $(last_dm_error)" || return 1
	[ "$(md5sum <"$img")" = "$sum" ] ||
		fail "the refused table changed the image" || return 1
	[ "$(blockdev --getsize64 /dev/mapper/gr)" = $((64 << 20)) ] ||
		fail "device size $(blockdev --getsize64 /dev/mapper/gr)" ||
		return 1
	must dmsetup suspend gr &&
		must dmsetup load gr --table "0 $((256 << 11)) qcow2 $img 1 grow" &&
		must dmsetup resume gr || return 1
	[ "$(blockdev --getsize64 /dev/mapper/gr)" = $((256 << 20)) ] ||
		fail "device size $(blockdev --getsize64 /dev/mapper/gr)" ||
		return 1
	[ "$(dm_status_field gr 2)" = $((256 << 11)) ] ||
		fail "status shows $(dm_status_field gr 2) sectors" || return 1
	qio -n -f raw -c "write -P 0x42 $((64 * 1048576 - 4096)) 8192" \
		-c "write -P 0x43 $((256 * 1048576 - 4096)) 4096" \
		/dev/mapper/gr || return 1
	dm_remove gr || return 1
	[ "$(img_sectors "$img")" = $((256 << 11)) ] ||
		fail "qemu sees $(img_sectors "$img") sectors" || return 1
	img_check "$img" || return 1
	qio -r -f qcow2 -c "read -P 0x41 $((64 * 1048576 - 8192)) 4096" \
		-c "read -P 0x42 $((64 * 1048576 - 4096)) 8192" \
		-c "read -P 0x43 $((256 * 1048576 - 4096)) 4096" \
		-c "read -P 0 $((128 << 20)) 1M" "$img" || return 1
	log "grown from 64 MiB to 256 MiB"

	DM_LEN=$((512 << 11)) expect_refused gr "$img 1 grow" \
		"Device length exceeds the image's virtual size" --readonly ||
		return 1
	must qemu-img create -q -f qcow2 -o cluster_size=512 small.qcow2 1M ||
		return 1
	DM_LEN=$((256 << 21)) expect_refused gr "$PWD/small.qcow2 1 grow" \
		"Growing this much needs an L1 table over 32 MiB" || return 1
	cd .. && rm -rf gr
}

# grow_move_case OPTS SIZE NEW [loop]: grow past what the L1 table's
# clusters can map: a new, larger L1 table replaces it. Data written
# before and after stays; the old table's clusters are freed (no leak).
grow_move_case() {
	local img dev l1a l1b new loop=${4:-}
	new=$(numfmt --from=iec "$3")
	newdir gm || return 1
	img=$PWD/g.qcow2
	must qemu-img create -q -f qcow2 -o "$1" "$img" "$2" || return 1
	qio -f qcow2 -c "write -P 0x51 0 64k" -c "write -P 0x52 $(($(numfmt --from=iec "$2") - 4096)) 4k" \
		"$img" || return 1
	l1a=$(od -An -tx1 -j40 -N8 "$img" | tr -d ' ')
	dev=$img
	if [ -n "$loop" ]; then
		grow_for_loop "$img" || return 1
		dev=$(losetup -f --show "$img") || fail "losetup" || return 1
	fi
	dm_create gm "$dev" || return 1
	must dmsetup suspend gm &&
		must dmsetup load gm --table "0 $((new / 512)) qcow2 $dev 1 grow" &&
		must dmsetup resume gm || { dm_remove gm; return 1; }
	qio -n -f raw -c "write -P 0x53 $((new - 8192)) 8k" \
		-c "write -P 0x54 $((new / 2 + 512)) 1k" -c "write -P 0x55 4k 4k" \
		/dev/mapper/gm || { dm_remove gm; return 1; }
	dm_remove gm || return 1
	[ -z "$loop" ] || losetup -d "$dev"
	l1b=$(od -An -tx1 -j40 -N8 "$img" | tr -d ' ')
	log "L1 table moved from 0x$l1a to 0x$l1b"
	[ "$l1a" != "$l1b" ] || fail "the L1 table did not move" || return 1
	[ "$(img_sectors "$img")" = $((new / 512)) ] ||
		fail "qemu sees $(img_sectors "$img") sectors" || return 1
	img_check "$img" || return 1
	qio -r -f qcow2 -c "read -P 0x51 0 4k" -c "read -P 0x55 4k 4k" \
		-c "read -P 0x51 8k 56k" \
		-c "read -P 0x52 $(($(numfmt --from=iec "$2") - 4096)) 4k" \
		-c "read -P 0x53 $((new - 8192)) 8k" \
		-c "read -P 0x54 $((new / 2 + 512)) 1k" \
		-c "read -P 0 $((new / 4)) 64k" "$img" || return 1
	cd .. && rm -rf gm
}

test_grow_move_l1_c512()	{ dm_only || return 0; grow_move_case cluster_size=512 1M 8M; }
test_grow_move_l1_c512_loop()	{ dm_only || return 0; grow_move_case cluster_size=512 1M 8M loop; }
test_grow_move_l1_16t()		{ dm_only || return 0; grow_move_case cluster_size=64k 64M 16T; }
