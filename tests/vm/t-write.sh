# shellcheck shell=bash
# Write path: data written through the device reads back the same through
# the device and through qemu, survives removal and re-creation, and leaves
# an image that "qemu-img check" finds clean (no corruption, no leaks).
#
# WRITE_DEV=dm (default) tests the dm-qcow2 target. WRITE_DEV=nbd runs the
# same cases against qemu-nbd on /dev/nbdN, a known good implementation,
# to check the test logic itself; cases about the target only (status
# fields, refusal messages, header bits qemu handles differently) skip.
# Set it in the guest (vm-run passes QCOW2_* variables, so QCOW2_WRITE_DEV
# works too):
#   scripts/vm-run --disk 16G -- env WRITE_DEV=nbd tests/vm/run-guest.sh t-write.sh

WRITE_DEV=${WRITE_DEV:-${QCOW2_WRITE_DEV:-dm}}
WDEV_STATE=/run/t-write-wdev
WDEV=

# ---- device under test ----------------------------------------------------

# dm_only: says why the case skips and returns 1 when WRITE_DEV is not dm.
dm_only() {
	[ "$WRITE_DEV" = dm ] && return 0
	log "skip: dm only"
	return 1
}

# The first /dev/nbdN with no server attached.
free_nbd() {
	local d
	for d in /sys/block/nbd*; do
		[ -e "$d/pid" ] && continue
		echo "/dev/${d##*/}"
		return 0
	done
	return 1
}

# wdev_create NAME IMG [loop] [ro]: serve the qcow2 image IMG (absolute
# path) as a block device and set WDEV to its path. "loop": through a loop
# device over IMG (the image file must have room to grow: see
# grow_for_loop). "ro": read-only.
wdev_create() {
	local name=$1 img=$2 loop='' ro='' opt path dev pid i len
	shift 2
	for opt; do
		case $opt in
		loop) loop=1 ;;
		ro) ro=1 ;;
		*) fail "wdev_create: unknown option $opt"; return 1 ;;
		esac
	done
	WDEV=
	mkdir -p "$WDEV_STATE"
	trap wdev_cleanup EXIT
	[ ! -e "$WDEV_STATE/$name" ] || fail "$name already exists" || return 1
	len=$(img_sectors "$img") || fail "cannot read $img" || return 1
	path=$img
	if [ -n "$loop" ]; then
		path=$(losetup -f --show ${ro:+-r} "$img") ||
			fail "losetup $img" || return 1
	fi
	case $WRITE_DEV in
	dm)
		if ! DM_LEN=$len dm_create "$name" "$path" ${ro:+--readonly} >&2; then
			[ -z "$loop" ] || losetup -d "$path"
			fail "cannot create $name over $path"
			return 1
		fi
		echo "dm /dev/mapper/$name - ${loop:+$path}" >"$WDEV_STATE/$name"
		WDEV=/dev/mapper/$name
		;;
	nbd)
		[ -e /sys/block/nbd0 ] || modprobe nbd max_part=0 ||
			fail "no nbd module" || return 1
		dev=$(free_nbd) || fail "no free nbd device" || return 1
		if ! qemu-nbd -f qcow2 --cache=none --aio=native ${ro:+-r} \
			-c "$dev" "$path" >&2; then
			[ -z "$loop" ] || losetup -d "$path"
			fail "qemu-nbd cannot serve $path"
			return 1
		fi
		echo "nbd $dev - ${loop:+$path}" >"$WDEV_STATE/$name"
		# The server thread's id; its process must be gone at removal
		for i in $(seq 100); do
			[ -e "/sys/block/${dev#/dev/}/pid" ] && break
			sleep 0.1
		done
		pid=$(cat "/sys/block/${dev#/dev/}/pid") ||
			fail "$dev not connected" || return 1
		pid=$(awk '/^Tgid:/ {print $2}' "/proc/$pid/status")
		echo "nbd $dev ${pid:--} ${loop:+$path}" >"$WDEV_STATE/$name"
		[ "$(blockdev --getsize64 "$dev")" = $((len * 512)) ] ||
			fail "$dev has the wrong size" || return 1
		WDEV=$dev
		;;
	*)
		fail "WRITE_DEV must be dm or nbd, not '$WRITE_DEV'"
		return 1
		;;
	esac
}

# wdev_remove NAME: remove the device; when this returns, all metadata is
# written back and nothing holds the image any more.
wdev_remove() {
	local kind dev pid loop i
	read -r kind dev pid loop <"$WDEV_STATE/$1" ||
		fail "no device $1" || return 1
	case $kind in
	dm)
		dm_remove "$1" || fail "cannot remove $1" || return 1
		;;
	nbd)
		qemu-nbd -d "$dev" >/dev/null || fail "qemu-nbd -d $dev" || return 1
		[ "$pid" != - ] || fail "no server pid for $dev" || return 1
		for i in $(seq 300); do
			[ -d "/proc/$pid" ] || break
			sleep 0.1
		done
		[ ! -d "/proc/$pid" ] || fail "qemu-nbd $pid did not exit" ||
			return 1
		;;
	esac
	rm -f "$WDEV_STATE/$1"
	[ -z "$loop" ] || losetup -d "$loop" || fail "losetup -d $loop"
}

# EXIT trap of a case: unmount and remove what a failed case left behind.
wdev_cleanup() {
	local f
	mountpoint -q "$SCRATCH/mnt" 2>/dev/null && umount "$SCRATCH/mnt"
	for f in "$WDEV_STATE"/*; do
		[ -e "$f" ] || continue
		wdev_remove "${f##*/}" >/dev/null 2>&1 || rm -f "$f"
	done
}

# ---- helpers ----------------------------------------------------------------

# newdir NAME: a fresh working directory for the case under $SCRATCH.
newdir() {
	rm -rf "${SCRATCH:?}/$1" && mkdir -p "$SCRATCH/$1" || return 1
	cd "$SCRATCH/$1" || return 1
}

# The loop backend cannot grow the image: give the file room first
# (the virtual size + 25 %, 32 MiB and 8 clusters for metadata).
grow_for_loop() {
	local size cs
	size=$(($(img_sectors "$1") * 512))
	cs=$(img_cluster_size "$1")
	must truncate -s $((size * 5 / 4 + (32 << 20) + 8 * cs)) "$1"
}

img_info_field() {
	qemu-img info -U --output=json "$1" |
		python3 -c "import json,sys; print(json.load(sys.stdin)[\"$2\"])"
}

img_cluster_size() { img_info_field "$1" cluster-size; }

# "qemu-img check" exits 0: no corruption and no leaked cluster.
img_check() {
	must qemu-img check "$1" || fail "qemu-img check: $1 not clean"
}

# The number of guest clusters allocated, as qemu-img check counts them.
img_allocated() {
	qemu-img check --output=json "$1" 2>/dev/null |
		python3 -c 'import json,sys; print(json.load(sys.stdin)["allocated-clusters"])'
}

# A byte of the image header, and setting/clearing bits in it.
hdr_byte() { od -An -tu1 -j "$2" -N1 "$1" | tr -d ' '; }
hdr_put_byte() {
	# shellcheck disable=SC2059
	printf "\\$(printf %03o "$3")" |
		dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}
hdr_set_bits() { hdr_put_byte "$1" "$2" $(($(hdr_byte "$1" "$2") | $3)); }
hdr_clear_bits() { hdr_put_byte "$1" "$2" $(($(hdr_byte "$1" "$2") & ~$3 & 255)); }

# Read the whole device (direct I/O) into a file.
dump_dev() {
	must dd if="$1" of="$2" bs=1M iflag=direct status=none
}

# qio ARGS...: qemu-io; fails on a non-zero exit or a failed verification.
qio() {
	local out
	out=$(qemu-io "$@" 2>&1)
	local rc=$?
	if [ $rc -ne 0 ] || echo "$out" | grep -qiE 'fail|error|invalid'; then
		echo "$out" | grep -vE '^(read|wrote) [0-9]+/|ops;' | head -n 10 >&2
		fail "qemu-io $1 $2 ... ${*: -1} (exit $rc)"
		return 1
	fi
}

# fsync a file or device (a flush request to a block device).
fsync_path() {
	python3 -c 'import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); os.fsync(fd); os.close(fd)' "$1"
}

# fio_write DEV SIZE SEQ_OFF SEQ_LEN: 20 MiB of random writes over the whole
# device (SIZE), then sequential writes of SEQ_LEN from SEQ_OFF,
# block sizes 512 B to 1 MiB on 512-byte boundaries, each job checking its
# own data (crc32c) after writing it.
FIO_BSSPLIT=512/15:1536/5:4k/20:7k/5:16k/10:64k/15:68k/5:256k/10:1m/15
fio_write() {
	must fio --filename="$1" --direct=1 --ioengine=libaio --iodepth=16 \
		--bssplit=$FIO_BSSPLIT --blockalign=512 \
		--verify=crc32c --do_verify=1 --verify_fatal=1 \
		--name=rand --rw=randwrite --size="$2" --io_size=20M \
		--name=seq --stonewall --rw=write --offset="$3" --size="$4"
}

# ---- 1. matrix: cluster sizes, versions, refcount widths, backends --------

# Writes at fixed places through qemu-io: across a cluster boundary, the
# first and the last sector, an odd length in the middle.
patterns() {
	local size=$1 cs=$2
	echo "0x5a $((3 * cs - 512)) 1536"
	echo "0xa5 0 512"
	echo "0x3c $((size - 4096)) 4096"
	echo "0xc3 $((size / 2 + 7 * 512)) $((100 * 1024 + 512))"
}

# matrix_case CREATE_OPTIONS SIZE [loop]
matrix_case() {
	local opts=$1 loop=${3:-} img dev size cs p o l wr=() rd=()
	newdir "m" || return 1
	img=$PWD/m.qcow2
	must qemu-img create -q -f qcow2 -o "$opts" "$img" "$2" || return 1
	size=$(($(img_sectors "$img") * 512))
	cs=$(img_cluster_size "$img")
	[ -z "$loop" ] || grow_for_loop "$img" || return 1
	while read -r p o l; do
		wr+=(-c "write -P $p $o $l")
		rd+=(-c "read -P $p $o $l")
	done < <(patterns "$size" "$cs")
	log "$opts, $2, ${loop:-file}, on $WRITE_DEV"

	wdev_create m "$img" ${loop:+"$loop"} || return 1
	dev=$WDEV
	fio_write "$dev" "$size" $((size / 4 + 3 * 512)) 12M ||
		return 1
	qio -f raw "${wr[@]}" "$dev" || return 1
	# What the device shows after the writes is the reference
	dump_dev "$dev" ref.raw || return 1
	wdev_remove m || return 1

	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1

	# Open it again (writable): the device still shows the same
	wdev_create m "$img" ${loop:+"$loop"} || return 1
	must qemu-img compare -U -f raw -F raw ref.raw "$WDEV" || return 1
	wdev_remove m || return 1
	img_check "$img" || return 1
	qio -r -f qcow2 "${rd[@]}" "$img" || return 1
	cd .. && rm -rf m
}

# Each cluster size, version and refcount width at least once with each
# backend (file, loop device).
test_m01_c512_v3_rb16_file()	{ matrix_case compat=1.1,cluster_size=512 64M; }
test_m02_c512_v2_loop()		{ matrix_case compat=0.10,cluster_size=512 64M loop; }
test_m03_c4k_v3_rb1_file()	{ matrix_case compat=1.1,cluster_size=4k,refcount_bits=1 64M; }
test_m04_c4k_v2_loop()		{ matrix_case compat=0.10,cluster_size=4k 64M loop; }
test_m05_c64k_v3_rb64_loop()	{ matrix_case compat=1.1,cluster_size=64k,refcount_bits=64 64M loop; }
test_m06_c64k_v2_file()		{ matrix_case compat=0.10,cluster_size=64k 64M; }
test_m07_c2m_v3_rb16_loop()	{ matrix_case compat=1.1,cluster_size=2M 128M loop; }
test_m08_c2m_v2_file()		{ matrix_case compat=0.10,cluster_size=2M 128M; }
test_m09_c64k_v3_rb1_loop()	{ matrix_case compat=1.1,cluster_size=64k,refcount_bits=1 64M loop; }
test_m10_c512_v3_rb64_file()	{ matrix_case compat=1.1,cluster_size=512,refcount_bits=64 64M; }

# ---- 2. every sector written -----------------------------------------------

# every_sector_case CREATE_OPTIONS SIZE: random data over the whole device
# in runs of direct writes of varied sizes (512 B to 1 MiB, run ends not on
# cluster boundaries); every cluster ends up allocated, exactly once.
every_sector_case() {
	local opts=$1 img dev size cs off bs n i=0 alloc
	local bss=(512 3584 4096 66048 1048576 131072 1536)
	newdir es || return 1
	img=$PWD/es.qcow2
	must qemu-img create -q -f qcow2 -o "$opts" "$img" "$2" || return 1
	size=$(($(img_sectors "$img") * 512))
	cs=$(img_cluster_size "$img")
	must dd if=/dev/urandom of=src.raw bs=1M count=$((size >> 20)) \
		status=none || return 1
	wdev_create es "$img" || return 1
	dev=$WDEV
	off=0
	while [ $off -lt "$size" ]; do
		bs=${bss[i % ${#bss[@]}]}
		n=$((size / 10 / bs))
		[ $n -ge 1 ] || n=1
		if [ $((off + n * bs)) -gt "$size" ]; then
			n=$(((size - off) / bs))
			[ $n -ge 1 ] || { bs=512; n=$(((size - off) / 512)); }
		fi
		must dd if=src.raw of="$dev" bs="$bs" count=$n skip=$off seek=$off \
			iflag=skip_bytes oflag=seek_bytes,direct conv=notrunc \
			status=none || return 1
		off=$((off + n * bs))
		i=$((i + 1))
	done
	log "$i runs of writes"
	must qemu-img compare -U -f raw -F raw src.raw "$dev" || return 1
	wdev_remove es || return 1
	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 src.raw "$img" || return 1
	alloc=$(img_allocated "$img")
	[ "$alloc" = $((size / cs)) ] ||
		fail "$alloc clusters allocated, want $((size / cs))" || return 1
	cd .. && rm -rf es
}

test_every_sector_c512()	{ every_sector_case cluster_size=512 8M; }
test_every_sector_c64k()	{ every_sector_case cluster_size=64k 32M; }

# ---- 3. scattered writes: many L2 tables, refcount blocks, table growth ----

# scatter_case IMG COUNT LEN ALIGN_BACK: COUNT writes of LEN bytes, each a
# different pattern, spread evenly over the virtual size; one in four
# starts ALIGN_BACK bytes before a cluster boundary. Then the same data
# is read from the image by qemu, the rest of each touched cluster as
# zeros, and qemu-img check counts exactly the clusters touched.
scatter_case() {
	local img=$1 count=$2 len=$3 back=$4 size cs stride k o p c0 c1
	local wr=() rd=() want=0
	size=$(($(img_sectors "$img") * 512))
	cs=$(img_cluster_size "$img")
	stride=$(((size - len - cs) / count / 512 * 512))
	for k in $(seq 0 $((count - 1))); do
		o=$((k * stride + (k * 7919 % (cs / 512)) * 512))
		[ $((k % 4)) -ne 1 ] || o=$(((o / cs + 1) * cs - back))
		p=$((k % 250 + 1))
		c0=$((o / cs * cs))
		c1=$(((o + len + cs - 1) / cs * cs))
		want=$((want + (c1 - c0) / cs))
		wr+=(-c "write -P $p $o $len")
		[ $o -eq $c0 ] || rd+=(-c "read -P 0 $c0 $((o - c0))")
		rd+=(-c "read -P $p $o $len")
		[ $((o + len)) -eq $c1 ] || rd+=(-c "read -P 0 $((o + len)) $((c1 - o - len))")
	done
	# The last sector of the device, in a cluster of its own
	wr+=(-c "write -P 0xee $((size - 512)) 512")
	rd+=(-c "read -P 0xee $((size - 512)) 512")
	want=$((want + 1))

	wdev_create sc "$img" || return 1
	# Direct I/O: through the page cache, 4 KiB pages would be written
	# whole and touch more clusters than counted (512-byte clusters)
	qio -n -f raw "${wr[@]}" "$WDEV" || return 1
	qio -n -r -f raw "${rd[@]}" "$WDEV" || return 1
	wdev_remove sc || return 1
	img_check "$img" || return 1
	qio -r -f qcow2 "${rd[@]}" "$img" || return 1
	[ "$(img_allocated "$img")" = "$want" ] ||
		fail "$(img_allocated "$img") clusters allocated, want $want" ||
		return 1
	log "$count writes, $want clusters, image $(stat -c %s "$img") bytes"
}

# 1 TiB virtual, 64 KiB clusters: each of 300 writes lands under a
# different L2 table (one maps 512 MiB).
test_scatter_1tib_c64k() {
	newdir sc || return 1
	must qemu-img create -q -f qcow2 "$PWD/big.qcow2" 1T || return 1
	scatter_case "$PWD/big.qcow2" 300 4096 2048 || return 1
	cd .. && rm -rf sc
}

# 512-byte clusters, 2 GiB virtual: a refcount block covers 128 KiB of the
# image file and the initial one-cluster refcount table 8 MiB; writing
# ~11 MiB (640 x 16.5 KiB, each under its own L2 table) needs ~90 new
# refcount blocks and a larger refcount table.
test_scatter_rtgrow_c512() {
	local img rtc
	newdir sc || return 1
	img=$PWD/small.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=512 "$img" 2G ||
		return 1
	rtc=$(od -An -tu4 --endian=big -j 56 -N 4 "$img" | tr -d ' ')
	[ "$rtc" = 1 ] || fail "test premise: refcount table of $rtc clusters" ||
		return 1
	scatter_case "$img" 640 16896 1024 || return 1
	rtc=$(od -An -tu4 --endian=big -j 56 -N 4 "$img" | tr -d ' ')
	log "refcount table: $rtc clusters"
	[ "$rtc" -gt 1 ] || fail "refcount table did not grow" || return 1
	cd .. && rm -rf sc
}

# ---- 4. file systems --------------------------------------------------------

# A fixed set of files from /usr/share/doc (2000, at most 24 MiB), read
# once from the host share: $SCRATCH/tree.tar, its list and sha256 sums.
make_tree() {
	local t=$SCRATCH/tree n
	[ -s "$t.sha" ] && return 0
	(cd / && find usr/share/doc -type f -size -200k -printf '%s %p\n') |
		sort -k2 | awk '{ t += $1; if (t > 24 * 1048576 || NR > 2000) exit
			print $2 }' >"$t.list"
	n=$(wc -l <"$t.list")
	[ "$n" -ge 1000 ] || fail "only $n files in the tree" || return 1
	rm -rf "$t" && mkdir -p "$t" || return 1
	must tar -C / -cf "$t.tar" -T "$t.list" || return 1
	must tar -C "$t" -xf "$t.tar" || return 1
	(cd "$t" && xargs -d '\n' sha256sum <"$t.list") >"$t.sha.new" &&
		mv "$t.sha.new" "$t.sha" && rm -rf "$t"
}

# fs_case TYPE SIZE CREATE_OPTIONS: make a file system on the device, copy
# the tree in, remove; then read-only: fsck finds nothing, files identical.
fs_case() {
	local type=$1 size=$2 opts=$3 img mnt=$SCRATCH/mnt t=$SCRATCH/tree
	newdir fs || return 1
	img=$PWD/fs.qcow2
	make_tree || return 1
	must qemu-img create -q -f qcow2 -o "$opts" "$img" "$size" || return 1
	wdev_create fs "$img" || return 1
	case $type in
	ext4) must mkfs.ext4 -q -F -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 "$WDEV" ;;
	xfs) must mkfs.xfs -q -f -K "$WDEV" ;;
	esac || return 1
	mkdir -p "$mnt"
	must mount -t "$type" "$WDEV" "$mnt" || return 1
	must tar -C "$mnt" -xf "$t.tar" || return 1
	must umount "$mnt" || return 1
	wdev_remove fs || return 1
	img_check "$img" || return 1

	wdev_create fs "$img" ro || return 1
	case $type in
	ext4) must e2fsck -fn "$WDEV" &&
		must mount -t ext4 -o ro,noload "$WDEV" "$mnt" ;;
	xfs) must xfs_repair -n "$WDEV" &&
		must mount -t xfs -o ro,norecovery "$WDEV" "$mnt" ;;
	esac || return 1
	(cd "$mnt" && xargs -d '\n' sha256sum <"$t.list") >got.sha
	must umount "$mnt" || return 1
	wdev_remove fs || return 1
	cmp -s "$t.sha" got.sha || { diff "$t.sha" got.sha | head >&2;
		fail "files differ"; return 1; }
	log "$(wc -l <"$t.list") files identical"
	img_check "$img" || return 1
	cd .. && rm -rf fs
}

test_fs_ext4()	{ fs_case ext4 256M cluster_size=4k; }
test_fs_xfs()	{ fs_case xfs 512M cluster_size=64k; }

# ---- 5. internal snapshot ---------------------------------------------------

# Data A, snapshot s1 (by qemu-img), then writes over the same ranges
# through the device: clusters shared with s1 must be copied, not
# overwritten. Reverting a copy to s1 gives A back; the image shows B.
test_snapshot() {
	local img size=64M
	newdir snap || return 1
	img=$PWD/s.qcow2
	must qemu-img create -q -f qcow2 "$img" $size || return 1
	must dd if=/dev/urandom of=a.raw bs=1M count=40 status=none || return 1
	wdev_create s "$img" || return 1
	must dd if=a.raw of="$WDEV" bs=64k seek=1 oflag=direct status=none ||
		return 1
	qio -f raw -c "write -P 0x11 $((50 << 20)) 3M" "$WDEV" || return 1
	dump_dev "$WDEV" pre.raw || return 1
	wdev_remove s || return 1
	img_check "$img" || return 1
	must qemu-img snapshot -c s1 "$img" || return 1

	wdev_create s "$img" || return 1
	must qemu-img compare -U -f raw -F raw pre.raw "$WDEV" || return 1
	# Over the same ranges: partial clusters, whole clusters, 1 MiB runs
	must fio --filename="$WDEV" --direct=1 --ioengine=libaio --iodepth=16 \
		--bssplit=$FIO_BSSPLIT --blockalign=512 \
		--verify=crc32c --do_verify=1 --verify_fatal=1 \
		--name=over --rw=randwrite --size=56M --io_size=16M || return 1
	qio -f raw -c "write -P 0x22 $((50 << 20 + 4096)) 1M" "$WDEV" ||
		return 1
	dump_dev "$WDEV" post.raw || return 1
	wdev_remove s || return 1

	img_check "$img" || return 1
	qemu-img snapshot -l "$img" | grep -qw s1 || fail "s1 gone" || return 1
	must qemu-img compare -U -f raw -F qcow2 post.raw "$img" || return 1
	must cp "$img" copy.qcow2 || return 1
	must qemu-img snapshot -a s1 copy.qcow2 || return 1
	must qemu-img compare -U -f raw -F qcow2 pre.raw copy.qcow2 || return 1
	img_check copy.qcow2 || return 1
	cd .. && rm -rf snap
}

# A new cluster at the end of an image file is not zeroed: writing its
# data extends the file, which then ends inside the cluster (as QEMU
# leaves it). The tail reads as zeros through the device and through qemu,
# the image is clean, and the cluster serves as a source of data that
# must read zeros there: a backing layer under a partial write of an
# overlay, and a snapshot-shared cluster copied on write. Then an in-place
# write to its tail.
test_tail_past_eof() {
	local img c=$((1 << 20)) sz
	dm_only || return 0
	newdir tail || return 1
	img=$PWD/t.qcow2
	must qemu-img create -q -f qcow2 "$img" 16M || return 1
	wdev_create t "$img" || return 1
	qio -f raw -c "write -P 0x31 $c 4k" "$WDEV" || return 1
	wdev_remove t || return 1
	sz=$(stat -c %s "$img")
	[ $((sz % 65536)) -ne 0 ] ||
		fail "test premise: the file ($sz bytes) ends on a cluster" ||
		return 1
	log "the file ends $((sz % 65536)) bytes into its last cluster"
	img_check "$img" || return 1
	qio -r -f qcow2 -c "read -P 0x31 $c 4k" -c "read -P 0 $((c + 4096)) 60k" \
		"$img" || return 1

	# A backing layer: the overlay's new cluster is filled from it
	must qemu-img create -q -f qcow2 -b "$img" -F qcow2 o.qcow2 16M ||
		return 1
	must cp o.qcow2 ref.qcow2 || return 1
	DM_LEN=$((16 << 11)) dm_create o "$PWD/o.qcow2 2 backing $img" ||
		return 1
	qio -f raw -c "write -P 0x32 $((c + 32768)) 4k" \
		-c "read -P 0x31 $c 4k" -c "read -P 0 $((c + 4096)) 28k" \
		-c "read -P 0 $((c + 36864)) 28k" /dev/mapper/o || return 1
	dm_remove o || return 1
	qio -f qcow2 -c "write -P 0x32 $((c + 32768)) 4k" ref.qcow2 || return 1
	img_check o.qcow2 || return 1
	must qemu-img compare -U o.qcow2 ref.qcow2 || return 1

	# Shared with a snapshot: copied on write
	must qemu-img snapshot -c s1 "$img" || return 1
	must cp "$img" ref.qcow2 || return 1
	wdev_create t "$img" || return 1
	qio -f raw -c "write -P 0x33 $((c + 16384)) 4k" "$WDEV" || return 1
	wdev_remove t || return 1
	qio -f qcow2 -c "write -P 0x33 $((c + 16384)) 4k" ref.qcow2 || return 1
	img_check "$img" || return 1
	must qemu-img compare -U "$img" ref.qcow2 || return 1

	# In place, past the end of the file again: a new cluster, then its tail
	wdev_create t "$img" || return 1
	qio -f raw -c "write -P 0x34 $((8 << 20)) 4k" "$WDEV" || return 1
	qio -f raw -c "write -P 0x35 $((8 << 20 | 61440)) 4k" \
		-c "read -P 0x34 $((8 << 20)) 4k" \
		-c "read -P 0 $((8 << 20 | 4096)) 56k" "$WDEV" || return 1
	wdev_remove t || return 1
	qio -f qcow2 -c "write -P 0x34 $((8 << 20)) 4k" \
		-c "write -P 0x35 $((8 << 20 | 61440)) 4k" ref.qcow2 || return 1
	img_check "$img" || return 1
	must qemu-img compare -U "$img" ref.qcow2 || return 1
	cd .. && rm -rf tail
}

# Writes that span clusters of every kind at once: allocated, shared
# with a snapshot, copied after it, unallocated, zero (over unallocated
# and over shared clusters), in runs and alone. Direct writes of 1-4 MiB
# start and end inside clusters, plain and FUA (oflag=dsync), and long
# runs go over unallocated space, which workers serve a group of clusters
# at a time. The device must show what the same writes give on a raw
# copy, before and after re-creation, the image must be clean and the
# snapshot's data unchanged.
SPAN_WRITES=(
	"$((3 * 65536 + 5 * 512)) 4194304 2 direct"
	"$((1048576 - 4096)) 1048576 6 dsync"
	"$((16 << 20 | 1536)) 2097152 4 direct"
	"$((24 << 20)) 1048576 6 dsync"
)
span_case() {
	local opts=$1 loop=${2:-} img w
	newdir span || return 1
	img=$PWD/sp.qcow2
	must qemu-img create -q -f qcow2 -o "$opts" "$img" 32M || return 1
	qio -f qcow2 -c "write -P 0x11 0 1M" -c "write -P 0x12 2M 64k" \
		-c "write -P 0x13 2304k 128k" -c "write -P 0x14 5M 1M" \
		-c "write -P 0x15 $((7 << 20 | 512)) 3k" "$img" || return 1
	must qemu-img snapshot -c s1 "$img" || return 1
	qio -f qcow2 -c "write -P 0x21 512k 256k" -c "write -z 3M 192k" \
		-c "write -z 5M 128k" -c "write -P 0x22 6M 64k" "$img" || return 1
	must qemu-img convert -O raw "$img" ref.raw || return 1
	must qemu-img convert -l snapshot.name=s1 -O raw "$img" s1.raw ||
		return 1
	must dd if=/dev/urandom of=d.raw bs=1M count=32 status=none || return 1
	[ -z "$loop" ] || grow_for_loop "$img" || return 1
	log "$opts, ${loop:-file}, on $WRITE_DEV"

	wdev_create sp "$img" ${loop:+"$loop"} || return 1
	for w in "${SPAN_WRITES[@]}"; do
		set -- $w
		must dd if=d.raw of="$WDEV" bs="$2" count="$3" skip="$1" \
			seek="$1" iflag=skip_bytes oflag=seek_bytes,"$4" \
			conv=notrunc status=none || return 1
		must dd if=d.raw of=ref.raw bs="$2" count="$3" skip="$1" \
			seek="$1" iflag=skip_bytes oflag=seek_bytes \
			conv=notrunc status=none || return 1
	done
	must qemu-img compare -U -f raw -F raw ref.raw "$WDEV" || return 1
	wdev_remove sp || return 1
	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1

	wdev_create sp "$img" ${loop:+"$loop"} || return 1
	must qemu-img compare -U -f raw -F raw ref.raw "$WDEV" || return 1
	wdev_remove sp || return 1
	must qemu-img convert -l snapshot.name=s1 -O raw "$img" s1-after.raw ||
		return 1
	must cmp s1.raw s1-after.raw || return 1
	cd .. && rm -rf span
}

test_span_mixed_file()	{ span_case cluster_size=64k; }
test_span_mixed_loop()	{ span_case cluster_size=64k loop; }
test_span_mixed_c512()	{ span_case cluster_size=512; }

# Sequential direct writes of 1 MiB + 4 KiB into an empty image, eight
# submitted at once (one plug): each write begins inside the cluster its
# predecessor ends in, parks on that cluster's allocation and comes back
# to a worker with its first cluster allocated and the rest of its group
# new, which it must write as one run (write_each()). Data checked by fio
# (crc32c), again after re-creation, and against the image; writes must
# have parked.
span_parked_case() {
	local opts=$1 loop=${2:-} img
	newdir spp || return 1
	img=$PWD/pp.qcow2
	must qemu-img create -q -f qcow2 -o "$opts" "$img" 48M || return 1
	[ -z "$loop" ] || grow_for_loop "$img" || return 1
	log "$opts, ${loop:-file}, on $WRITE_DEV"
	wdev_create pp "$img" ${loop:+"$loop"} || return 1
	set -- --filename="$WDEV" --direct=1 --ioengine=libaio --iodepth=8 \
		--name=pp --rw=write --bs=$((1048576 + 4096)) --offset=4096 \
		--size=40M --verify=crc32c --verify_fatal=1
	not_dm || trace_start qcow2_park || return 1
	must fio "$@" --iodepth_batch_submit=8 --do_verify=1 >/dev/null ||
		return 1
	not_dm || trace_positive qcow2_park || return 1
	dump_dev "$WDEV" ref.raw || return 1
	wdev_remove pp || return 1
	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1
	wdev_create pp "$img" ${loop:+"$loop"} || return 1
	must fio "$@" --verify_only >/dev/null || return 1
	wdev_remove pp || return 1
	cd .. && rm -rf spp
}

test_span_parked_file()	{ span_parked_case cluster_size=64k; }
test_span_parked_loop()	{ span_parked_case cluster_size=64k loop; }

# Through the device's page cache: write-back sends 4 KiB bios, which the
# file backend merges where they continue each other in the image
# (clusters written in place, contiguous on the host) and must not merge
# across a host discontinuity or into clusters being allocated. The
# clusters were allocated out of guest order, so host runs break inside
# the written range; reads come back through read-ahead after the cache
# is dropped. Device and image must show what a raw copy shows.
test_buffered_merge() {
	local img
	newdir bm || return 1
	img=$PWD/bm.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=64k "$img" 32M ||
		return 1
	qio -f qcow2 -c "write -P 0x31 8M 4M" -c "write -P 0x32 0 4M" \
		-c "write -P 0x33 4M 2M" "$img" || return 1
	must qemu-img convert -O raw "$img" ref.raw || return 1
	must dd if=/dev/urandom of=d.raw bs=1M count=16 status=none || return 1
	wdev_create bm "$img" || return 1
	# Guest 1M..17M: in place up to 6M and 8M..12M, allocating elsewhere
	must dd if=d.raw of="$WDEV" bs=256k seek=4 conv=notrunc,fsync \
		status=none || return 1
	must dd if=d.raw of=ref.raw bs=256k seek=4 conv=notrunc status=none ||
		return 1
	must blockdev --flushbufs "$WDEV" || return 1
	must cmp ref.raw "$WDEV" || return 1
	wdev_remove bm || return 1
	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1
	cd .. && rm -rf bm
}

# True when the tests run on another implementation (WRITE_DEV=nbd): the
# trace checks are for dm-qcow2 only.
not_dm() {
	[ "$WRITE_DEV" != dm ]
}

# Page-cache write-back into new clusters sends a 4 KiB bio per page: the
# first bio of a cluster allocates it, the others park on that write and
# are written with it (gathered), zeros between them where no page was
# dirty. Patterns, written through the page cache of the device and into
# a raw copy alike (tests/vm/gather-writes.py): whole clusters; every
# other page; pages out of order with gaps; pages in a zero cluster
# (v3); a page in place. The device (read back with direct I/O) and the
# image must show what the raw copy shows, and the trace must show writes
# gathered, and held writes written in batches.
gather_case() {
	local opts=$1 backend=${2:-} img
	newdir ga || return 1
	img=$PWD/g.qcow2
	must qemu-img create -q -f qcow2 -o "$opts" "$img" 32M || return 1
	qio -f qcow2 -c "write -z 20M 2M" -c "write -P 0x5a 24M 64k" "$img" ||
		return 1
	must qemu-img convert -O raw "$img" ref.raw || return 1
	[ "$backend" != loop ] || grow_for_loop "$img" || return 1
	wdev_create ga "$img" $backend || return 1
	not_dm || trace_start qcow2_gather 'qcow2_batch:held > 1' ||
		return 1
	must python3 "$QCOW2_TOP/tests/vm/gather-writes.py" "$WDEV" ref.raw ||
		return 1
	not_dm || trace_positive qcow2_gather qcow2_batch || return 1
	dump_dev "$WDEV" dev.raw || return 1
	must cmp ref.raw dev.raw || return 1
	wdev_remove ga || return 1
	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1
	cd .. && rm -rf ga
}

test_gather_c64k_file()	{ gather_case cluster_size=64k; }
test_gather_c2m_loop()	{ gather_case cluster_size=2M loop; }
test_gather_c64k_v2_file()	{ gather_case compat=0.10,cluster_size=64k; }
test_gather_c2m_file()	{ gather_case cluster_size=2M; }
test_gather_c64k_loop()	{ gather_case cluster_size=64k loop; }

# The same patterns over a backing layer: write-back's held writes into
# clusters that follow each other are batched (plug_hold()), but these
# clusters are filled from the layer below, so each write of the batch
# goes its own way (copy on write) instead: no batch may be written as
# one. The zero cluster at 20M (v3) is fresh, but shares its batch with
# clusters that are not, so it too goes its own way.
test_gather_backing() {
	local img base n
	dm_only || return 0
	newdir gb || return 1
	img=$PWD/o.qcow2
	base=$PWD/b.qcow2
	must qemu-img create -q -f qcow2 "$base" 32M || return 1
	qio -f qcow2 -c "write -P 0x61 0 32M" "$base" || return 1
	must qemu-img create -q -f qcow2 -b "$base" -F qcow2 "$img" 32M ||
		return 1
	qio -f qcow2 -c "write -z 20M 2M" -c "write -P 0x5a 24M 64k" "$img" ||
		return 1
	must qemu-img convert -O raw "$img" ref.raw || return 1
	DM_LEN=$((32 << 11)) dm_create gb "$img 2 backing $base" || return 1
	trace_start 'qcow2_batch:held > 1' || return 1
	must python3 "$QCOW2_TOP/tests/vm/gather-writes.py" /dev/mapper/gb \
		ref.raw || return 1
	n=$(trace_count qcow2_batch) || return 1
	[ "$n" = 0 ] ||
		fail "$n batches over a backing layer written as one" ||
		return 1
	dump_dev /dev/mapper/gb dev.raw || return 1
	must cmp ref.raw dev.raw || return 1
	dm_remove gb || return 1
	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1
	cd .. && rm -rf gb
}

# Page-cache write-back in place sends one 4 KiB bio per page. With the
# file backend (direct I/O) the bios that continue each other are held
# under the flusher's plug and go to the image file as one kiocb
# (qcow2_io_file_queue()). Write 8 MiB through the page cache of a device
# over allocated clusters twice: the data must land; the second time,
# with the slices cached, no bio may go to a worker (none parked) and at
# least half of the 2048 pages must be merged. (The first write reads
# the slices: its bios park while they load, how many depends on the
# scheduler, so it is only logged.)
test_writeback_merge() {
	local img n p m
	dm_only || return 0
	newdir wm || return 1
	img=$PWD/m.qcow2
	must qemu-img create -q -f qcow2 "$img" 16M || return 1
	qio -f qcow2 -c "write -P 0x11 0 16M" "$img" || return 1
	must qemu-img convert -O raw "$img" ref.raw || return 1
	DM_LEN=$((16 << 11)) dm_create wm "$img" || return 1
	for n in 1 2; do
		must dd if=/dev/urandom of=d.raw bs=1M count=8 status=none ||
			return 1
		must dd if=d.raw of=ref.raw bs=1M seek=4 conv=notrunc \
			status=none || return 1
		trace_start qcow2_park qcow2_file_merge || return 1
		must dd if=d.raw of=/dev/mapper/wm bs=1M seek=4 conv=fsync \
			status=none || return 1
		p=$(trace_count qcow2_park) &&
			m=$(trace_count qcow2_file_merge bios) || return 1
		log "write $n: $p bios parked, $m merged"
	done
	[ "$p" = 0 ] ||
		fail "$p bios parked with the slices cached" || return 1
	[ "$m" -ge 1024 ] ||
		fail "$m of 2048 write-back bios merged" || return 1
	dump_dev /dev/mapper/wm dev.raw || return 1
	must cmp ref.raw dev.raw || return 1
	dm_remove wm || return 1
	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1
	cd .. && rm -rf wm
}

# ---- 6. concurrency ---------------------------------------------------------

# 16 jobs at once, each in its own region of 1 MiB + 1.5 KiB: regions are
# disjoint, so each job can check its own data (crc32c), but neighbouring
# regions share clusters (4 KiB) and all share L2 slices, so allocating
# writes race on the same clusters and tables.
test_conc_disjoint_verify() {
	local img reg=$((1048576 + 1536))
	newdir cd || return 1
	img=$PWD/c.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 64M ||
		return 1
	wdev_create c "$img" || return 1
	must fio --filename="$WDEV" --direct=1 --ioengine=libaio --iodepth=8 \
		--bssplit=512/20:1536/10:4k/30:12k/15:64k/15:256k/10 \
		--blockalign=512 --verify=crc32c --do_verify=1 --verify_fatal=1 \
		--name=d --numjobs=16 --rw=randwrite --size=$reg \
		--offset=$((4 << 20)) --offset_increment=$reg || return 1
	dump_dev "$WDEV" ref.raw || return 1
	wdev_remove c || return 1
	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1
	cd .. && rm -rf cd
}

# 16 jobs at once writing random places of the same 16 MiB (64 KiB
# clusters, all unallocated at first), each job with its own byte value
# and log of writes. Who wins an overlap is not defined, but every sector
# must hold the value of one of the jobs that wrote it (zero if none did):
# a lost allocating write, a torn sector or a write landing elsewhere fails.
# The result must then be what the image holds and what the device shows
# again after re-creation.
test_conc_overlap() {
	local img j out rc
	newdir co || return 1
	img=$PWD/c.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	wdev_create c "$img" || return 1
	{
		echo "[global]"
		echo "filename=$WDEV"
		echo "direct=1"
		echo "ioengine=libaio"
		echo "iodepth=8"
		echo "rw=randwrite"
		echo "bssplit=512/20:1536/10:4k/30:12k/15:64k/15:256k/10"
		echo "blockalign=512"
		echo "offset=0"
		echo "size=16m"
		echo "io_size=2m"
		echo "scramble_buffers=0"
		for j in $(seq 1 16); do
			echo "[j$j]"
			echo "buffer_pattern=$j"
			echo "randseed=$((1000 + j))"
			echo "write_iolog=$PWD/j$j.iolog"
		done
	} >over.fio
	must fio over.fio || return 1
	dump_dev "$WDEV" r1.raw || return 1
	out=$(python3 - r1.raw j*.iolog 2>&1 <<'EOF'
import sys
dump = open(sys.argv[1], "rb").read()
n = len(dump) // 512
mask = [0] * n
writes = 0
for path in sys.argv[2:]:
    job = int(path.rsplit("j", 1)[1].split(".")[0])
    for line in open(path):
        f = line.split()
        if "write" not in f:
            continue
        i = f.index("write")
        off, ln = int(f[i + 1]), int(f[i + 2])
        assert off % 512 == 0 and ln % 512 == 0, line
        writes += 1
        for s in range(off // 512, (off + ln) // 512):
            mask[s] |= 1 << job
assert writes > 1000, "only %d writes logged" % writes
bad = []
for s in range(n):
    sec = dump[s * 512:(s + 1) * 512]
    b = sec[0]
    if sec.count(b) != 512 or not ((b == 0 and mask[s] == 0) or
                                   (b and mask[s] >> b & 1)):
        bad.append(s)
both = sum(1 for m in mask if m & (m - 1))
print("%d writes, %d sectors written by 2+ jobs, %d bad" % (writes, both, len(bad)))
assert both > 1000, "jobs barely overlapped"
for s in bad[:10]:
    sec = dump[s * 512:(s + 1) * 512]
    print("sector %d: bytes %s, written by jobs %s" % (s, sorted(set(sec))[:4],
          [j for j in range(17) if mask[s] >> j & 1]))
sys.exit(1 if bad else 0)
EOF
	)
	rc=$?
	log "$out"
	[ $rc -eq 0 ] || fail "sectors hold data that no job wrote there" ||
		return 1
	wdev_remove c || return 1
	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 r1.raw "$img" || return 1
	wdev_create c "$img" || return 1
	dump_dev "$WDEV" r2.raw || return 1
	wdev_remove c || return 1
	cmp r1.raw r2.raw || fail "device reads differently after re-creation" ||
		return 1
	img_check "$img" || return 1
	cd .. && rm -rf co
}

# ---- 7. header bits ----------------------------------------------------------

# Bits of the incompatible features (u64 at 72) and autoclear features
# (u64 at 88), big-endian: the lowest bits are in bytes 79 and 95.
DIRTY_BYTE=79 DIRTY_BIT=1 CORRUPT_BIT=2 AUTOCLEAR_BYTE=95 BITMAPS_BIT=1

# Lazy refcounts: the dirty bit may be set while the device is live (logged
# only: updating refcounts eagerly is allowed too) but is clear after a
# clean removal, and the image is consistent.
test_hdr_lazy_clean() {
	local img
	newdir lz || return 1
	img=$PWD/lz.qcow2
	must qemu-img create -q -f qcow2 -o lazy_refcounts=on "$img" 64M ||
		return 1
	wdev_create lz "$img" || return 1
	must fio --filename="$WDEV" --direct=1 --ioengine=libaio --iodepth=16 \
		--bssplit=$FIO_BSSPLIT --blockalign=512 --name=w --rw=randwrite \
		--size=64M --io_size=16M || return 1
	must fsync_path "$WDEV" || return 1
	log "dirty bit while live: $(($(hdr_byte "$img" $DIRTY_BYTE) & DIRTY_BIT))"
	dump_dev "$WDEV" ref.raw || return 1
	wdev_remove lz || return 1
	[ $(($(hdr_byte "$img" $DIRTY_BYTE) & DIRTY_BIT)) = 0 ] ||
		fail "dirty bit still set after removal" || return 1
	img_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1
	cd .. && rm -rf lz
}

# lazy_live NAME BYTE: in a fresh directory NAME, a 64 MiB lazy-refcounts
# image (its path in the caller's img) served as NAME, with 256 KiB of
# BYTE written at 1 MiB through the device.
lazy_live() {
	newdir "$1" || return 1
	img=$PWD/$1.qcow2
	must qemu-img create -q -f qcow2 -o lazy_refcounts=on "$img" 64M &&
		wdev_create "$1" "$img" &&
		qio -n -f raw -c "write -P $2 1M 256k" "$WDEV"
}

# A table reload (dmsetup load, then resume) of a live lazy-refcounts
# image whose dirty bit the live table set: the new table loads (the bit
# is the live table's, cleared when it is suspended), takes over, and the
# data of both reads back; a clean removal leaves the image clean.
test_hdr_lazy_reload() {
	local img tbl
	dm_only || return 0
	lazy_live lr 0x61 || return 1
	[ $(($(hdr_byte "$img" $DIRTY_BYTE) & DIRTY_BIT)) != 0 ] ||
		fail "test premise: the dirty bit is not set while live" || return 1
	tbl=$(dmsetup table lr)
	must dmsetup load lr --table "$tbl" ||
		fail "reload refused: $(last_dm_error)" || return 1
	must dmsetup resume lr || return 1
	qio -n -f raw -c "write -P 0x62 9M 256k" -c "read -P 0x61 1M 256k" \
		"$WDEV" || return 1
	wdev_remove lr || return 1
	[ $(($(hdr_byte "$img" $DIRTY_BYTE) & DIRTY_BIT)) = 0 ] ||
		fail "dirty bit still set after removal" || return 1
	img_check "$img" || return 1
	qio -r -f qcow2 -c "read -P 0x61 1M 256k" -c "read -P 0x62 9M 256k" \
		"$img" || return 1
	cd .. && rm -rf lr
}

# A resume that cannot read the image back (an unknown incompatible bit
# appeared while the device was suspended) fails; the table is then in
# fail mode and writes nothing, removal included. Without the bit the
# image activates again and is clean.
test_resume_refused() {
	local img
	dm_only || return 0
	lazy_live rr 0x63 || return 1
	must dmsetup suspend rr || return 1
	hdr_set_bits "$img" $DIRTY_BYTE 128
	dmsetup resume rr 2>/dev/null && fail "resumed over an unknown bit" &&
		return 1
	[ "$(dm_status_field rr 1)" = fail ] ||
		fail "mode $(dm_status_field rr 1) after a failed resume" || return 1
	wdev_remove rr || return 1
	hdr_clear_bits "$img" $DIRTY_BYTE 128
	img_check "$img" || return 1
	wdev_create rr "$img" || return 1
	qio -r -f raw -c "read -P 0x63 1M 256k" "$WDEV" || return 1
	wdev_remove rr || return 1
	img_check "$img" || return 1
	cd .. && rm -rf rr
}

# refused_bit BIT MESSAGE: an image with BIT set in the incompatible
# features is refused writable with MESSAGE, unchanged by the attempt, and
# served read-only with its data; without the bit it is writable again.
refused_bit() {
	local bit=$1 msg=$2 img sum len
	newdir hb || return 1
	img=$PWD/hb.qcow2
	must qemu-img create -q -f qcow2 -o lazy_refcounts=on "$img" 64M ||
		return 1
	must qemu-io -f qcow2 -c "write -P 0x33 1M 3M" -c "write -P 0x44 40M 64k" \
		"$img" || return 1
	must qemu-img convert -O raw "$img" ref.raw || return 1
	hdr_set_bits "$img" $DIRTY_BYTE "$bit"
	sum=$(sha256sum <"$img")
	len=$(img_sectors "$img")

	if dmsetup create hb --table "0 $len qcow2 $img" 2>/dev/null; then
		dm_remove hb
		fail "writable table accepted with bit $bit set"
		return 1
	fi
	dmesg | tail -n 10 | grep -qF -- "$msg" ||
		fail "expected '$msg', kernel said: $(last_dm_error)" || return 1
	[ "$(sha256sum <"$img")" = "$sum" ] ||
		fail "the refused activation changed the image" || return 1

	wdev_create hb "$img" ro || return 1
	[ "$(dm_status_field hb 1)" = ro ] ||
		fail "mode $(dm_status_field hb 1), want ro" || return 1
	must qemu-img compare -U -f raw -F raw ref.raw "$WDEV" || return 1
	wdev_remove hb || return 1
	[ "$(sha256sum <"$img")" = "$sum" ] ||
		fail "the read-only activation changed the image" || return 1

	# The same image without the bit is accepted writable
	hdr_clear_bits "$img" $DIRTY_BYTE "$bit"
	wdev_create hb "$img" || return 1
	wdev_remove hb || return 1
	img_check "$img" || return 1
	cd .. && rm -rf hb
}

test_hdr_dirty_refused() {
	dm_only || return 0
	refused_bit $DIRTY_BIT "run qemu-img check -r all"
}

test_hdr_corrupt_refused() {
	dm_only || return 0
	refused_bit $CORRUPT_BIT "Image is marked corrupt"
}

# Persistent bitmaps: the target does not update them, so writing must
# clear autoclear bit 0 (the bitmaps are then inconsistent, as the spec
# says). qemu then no longer reads the bitmaps extension, so the clusters
# of the bitmap directory and tables show as leaks unless the target also
# dropped them: check must find no corruption, and no leak other than
# those clusters (found beforehand by clearing the bit on a copy).
test_hdr_autoclear_bitmaps() {
	local img out rc leaks
	newdir ac || return 1
	img=$PWD/ac.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	must qemu-io -f qcow2 -c "write -P 0x55 0 2M" "$img" || return 1
	must qemu-img bitmap --add "$img" b0 || return 1
	[ $(($(hdr_byte "$img" $AUTOCLEAR_BYTE) & BITMAPS_BIT)) = 1 ] ||
		fail "test premise: no bitmaps bit" || return 1
	cp "$img" probe.qcow2
	hdr_clear_bits probe.qcow2 $AUTOCLEAR_BYTE $BITMAPS_BIT
	qemu-img check probe.qcow2 2>&1 | grep -o 'Leaked cluster [0-9]*' |
		sort >bitmap-clusters
	log "bitmap clusters: $(wc -l <bitmap-clusters)"

	wdev_create ac "$img" || return 1
	must fio --filename="$WDEV" --direct=1 --ioengine=libaio --iodepth=16 \
		--bssplit=$FIO_BSSPLIT --blockalign=512 --name=w --rw=randwrite \
		--size=64M --io_size=8M || return 1
	dump_dev "$WDEV" ref.raw || return 1
	wdev_remove ac || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1
	if [ "$WRITE_DEV" != dm ]; then
		# qemu keeps bitmaps up to date and the bit set
		log "bitmaps bit: $(($(hdr_byte "$img" $AUTOCLEAR_BYTE) & BITMAPS_BIT)) (bit check: dm only)"
		img_check "$img" || return 1
		cd .. && rm -rf ac
		return 0
	fi
	[ $(($(hdr_byte "$img" $AUTOCLEAR_BYTE) & BITMAPS_BIT)) = 0 ] ||
		fail "bitmaps autoclear bit still set" || return 1
	out=$(qemu-img check "$img" 2>&1)
	rc=$?
	echo "$out" | grep -o 'Leaked cluster [0-9]*' | sort >leaks
	leaks=$(comm -23 leaks bitmap-clusters)
	log "qemu-img check: exit $rc, $(wc -l <leaks) leaked (bitmap) clusters"
	if [ $rc -ne 0 ] && { [ $rc -ne 3 ] || [ -n "$leaks" ]; }; then
		echo "$out" | tail -n 20 >&2
		fail "qemu-img check: exit $rc${leaks:+, leaks outside the bitmaps}"
		return 1
	fi
	must qemu-img check -r leaks "$img" || return 1
	img_check "$img" || return 1
	cd .. && rm -rf ac
}

# ---- 8. status ----------------------------------------------------------------

# Mode rw; allocated clusters grow with allocating writes and not with
# overwrites; dirty slices after an allocating write, none after a flush.
test_status() {
	local img a0 a1 a2 d1 st
	dm_only || return 0
	newdir st || return 1
	img=$PWD/st.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	wdev_create st "$img" || return 1
	st=$(dmsetup status st)
	log "status: $st"
	# shellcheck disable=SC2086
	set -- $st
	[ $# -eq 13 ] || fail "$(($# - 3)) status fields, want 10" || return 1
	[ "$4" = rw ] || fail "mode $4, want rw" || return 1
	[ "$5" = $((64 << 11)) ] || fail "virtual sectors $5" || return 1
	[ "$6" = 65536 ] || fail "cluster size $6" || return 1
	[ "${11}" = ok ] || fail "health ${11}" || return 1
	a0=${12}

	must dd if=/dev/urandom of="$WDEV" bs=64k count=4 seek=100 \
		oflag=direct status=none || return 1
	a1=$(dm_status_field st 9)
	d1=$(dm_status_field st 10)
	log "after 4 allocating writes: allocated $a0 -> $a1, dirty slices $d1"
	[ "$a1" -ge $((a0 + 4)) ] || fail "allocated $a0 -> $a1" || return 1
	[ "$d1" -gt 0 ] || fail "no dirty slice before a flush" || return 1
	must fsync_path "$WDEV" || return 1
	[ "$(dm_status_field st 10)" = 0 ] ||
		fail "$(dm_status_field st 10) dirty slices after a flush" ||
		return 1

	must dd if=/dev/urandom of="$WDEV" bs=64k count=4 seek=100 \
		oflag=direct status=none || return 1
	a2=$(dm_status_field st 9)
	[ "$a2" = "$a1" ] || fail "overwrites allocated: $a1 -> $a2" || return 1
	[ "$(dm_status_field st 8)" = ok ] || fail "health not ok" || return 1
	wdev_remove st || return 1
	img_check "$img" || return 1

	wdev_create st "$img" ro || return 1
	[ "$(dm_status_field st 1)" = ro ] || fail "read-only mode not ro" ||
		return 1
	wdev_remove st || return 1
	cd .. && rm -rf st
}

# ---- 9. a full block device ----------------------------------------------------

# The image on a loop device with room for a few clusters only: the write
# that needs a cluster past the end fails with ENOSPC, the device stays
# writable where clusters exist, and what was written before is intact.
test_enospc_bdev() {
	local img dev out done_bytes
	dm_only || return 0
	newdir ns || return 1
	img=$PWD/ns.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	must truncate -s 1M "$img" || return 1
	head -c 4M /dev/urandom >data || fail "no random data" || return 1
	wdev_create ns "$img" loop || return 1
	dev=$WDEV
	out=$(dd if=data of="$dev" bs=64k oflag=direct 2>&1) &&
		fail "4 MiB fitted in a 1 MiB device" && return 1
	echo "$out" | grep -q 'No space left on device' ||
		fail "dd: $out" || return 1
	done_bytes=$(echo "$out" | sed -n 's/^\([0-9]*\) bytes.*/\1/p')
	log "written before ENOSPC: $done_bytes bytes"
	[ "$done_bytes" -ge 65536 ] || fail "nothing was written" || return 1
	[ "$(dm_status_field ns 1)" = rw ] ||
		fail "mode $(dm_status_field ns 1) after ENOSPC" || return 1
	# Overwriting allocated clusters still works
	must dd if=data of="$dev" bs=64k count=1 oflag=direct,sync status=none ||
		return 1
	cmp -n "$done_bytes" data "$dev" || fail "device content differs" ||
		return 1
	wdev_remove ns || return 1
	# Leaks are allowed here (a cluster taken for a failed write), not
	# corruption
	local rc=0
	qemu-img check "$img" >check.out 2>&1 || rc=$?
	[ $rc = 0 ] || [ $rc = 3 ] ||
		{ cat check.out >&2; fail "qemu-img check: exit $rc"; return 1; }
	log "qemu-img check: exit $rc"
	must qemu-img convert -O raw "$img" back.raw || return 1
	cmp -n "$done_bytes" data back.raw || fail "image content differs" ||
		return 1
	cd .. && rm -rf ns
}
