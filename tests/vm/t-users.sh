# shellcheck shell=bash
# How people use the target: the scripts/qcow2-dmsetup helper (tables it
# builds, devices it makes and removes, what it refuses and why), LVM on a
# dm-qcow2 device, and a qcow2 image kept on an LVM logical volume.

QD=$QCOW2_TOP/scripts/qcow2-dmsetup
export LVM_SUPPRESS_FD_WARNINGS=1

# LVM in the guest: no udev, no dmeventd, a read-only /etc (no metadata
# backups), and only device-mapper and loop devices scanned (the scratch
# disk holds a file system).
LVMCONF='activation { udev_sync=0 udev_rules=0 monitoring=0 }
devices { obtain_device_list_from_udev=0 use_devicesfile=0 hints="none"
	scan_lvs=0 filter=[ "a|^/dev/mapper/|", "a|^/dev/dm-|",
	"a|^/dev/loop|", "r|.*|" ] }
backup { backup=0 archive=0 }'

lvm_() {
	local cmd=$1
	shift
	lvm "$cmd" --config "$LVMCONF" "$@"
}

# u_cleanup: EXIT trap of a case; undoes what a failed case left (file
# systems, volume groups, devices), in stacking order.
U_VGS=()
u_cleanup() {
	local vg
	mountpoint -q "$SCRATCH/umnt" 2>/dev/null && umount "$SCRATCH/umnt"
	for vg in "${U_VGS[@]}"; do
		lvm_ vgchange -an "$vg" >/dev/null 2>&1
	done
	cleanup_all
	# dm-linear devices of test_bdev_dm_linear (below the qcow2 ones)
	dmsetup remove ulin >/dev/null 2>&1
	losetup -D 2>/dev/null
}

u_newdir() {
	rm -rf "${SCRATCH:?}/$1" && mkdir -p "$SCRATCH/$1" && cd "$SCRATCH/$1" || return 1
}

# "qemu-img check" finds no corruption and no leaked cluster.
u_check() {
	must qemu-img check "$1" || fail "qemu-img check: $1 not clean"
}

# expect_msg TEXT CMD...: CMD must fail (exit 1) and print TEXT.
expect_msg() {
	local text=$1 out rc
	shift
	out=$("$@" 2>&1)
	rc=$?
	[ $rc -eq 1 ] || fail "'$*' exited $rc, want 1: $out" || return 1
	case $out in
	*"$text"*) log "refused: ${out%%$'\n'*}" ;;
	*) fail "'$*' said '$out', want '$text'"; return 1 ;;
	esac
}

# ---- the helper -------------------------------------------------------------

# A plain image: the table printed, the device made, written and removed,
# the table as loaded, read-only and cache size options.
test_helper_plain() {
	local img out want
	trap u_cleanup EXIT
	u_newdir helper || return 1
	img=$PWD/a.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	want="0 131072 qcow2 $img"
	out=$("$QD" table a.qcow2) || fail "table failed" || return 1
	[ "$out" = "$want" ] || fail "table '$out', want '$want'" || return 1
	out=$("$QD" table "$img" --cache-size 8m)
	[ "$out" = "$want 2 cache_size 8m" ] ||
		fail "table with cache '$out'" || return 1

	out=$("$QD" create ua "$img") || fail "create failed: $out" || return 1
	[ "$out" = /dev/mapper/ua ] || fail "create printed '$out'" || return 1
	[ -b /dev/mapper/ua ] || fail "no /dev/mapper/ua" || return 1
	[ "$(dmsetup table ua)" = "$want" ] ||
		fail "loaded table '$(dmsetup table ua)'" || return 1
	must qemu-io -f raw -c "write -P 0x6b 1M 3M" -c "write -P 0x17 63M 1M" \
		/dev/mapper/ua || return 1
	expect_msg "a device-mapper device named ua exists already" \
		"$QD" create ua "$img" || return 1
	must "$QD" remove ua || return 1
	[ ! -e /dev/mapper/ua ] || fail "/dev/mapper/ua still exists" || return 1
	u_check "$img" || return 1
	must qemu-io -r -f qcow2 -c "read -P 0x6b 1M 3M" -c "read -P 0x17 63M 1M" \
		-c "read -P 0 0 1M" "$img" || return 1

	# Read-only with a cache size: writes fail, the data is there
	must "$QD" create ub "$img" --readonly --cache-size 8m || return 1
	[ "$(dmsetup table ub)" = "$want 2 cache_size 8m" ] ||
		fail "loaded table '$(dmsetup table ub)'" || return 1
	dmsetup info ub | grep -q '^State:.*READ-ONLY' ||
		fail "ub is not read-only" || return 1
	if dd if=/dev/zero of=/dev/mapper/ub bs=4k count=1 oflag=direct \
		status=none 2>/dev/null; then
		fail "a write to a read-only device succeeded"
		return 1
	fi
	must qemu-io -r -f raw -c "read -P 0x6b 1M 3M" /dev/mapper/ub || return 1
	# A second read-only mapping of the same image is allowed
	must "$QD" create uc "$img" -r || return 1
	must cmp /dev/mapper/ub /dev/mapper/uc || return 1
	must "$QD" remove uc || return 1
	must "$QD" remove ub || return 1
	u_check "$img"
}

# What the helper refuses, with its reason: a missing image, a raw image,
# an image already in use (by a dm-qcow2 device, a loop device, a process),
# removing what is not a qcow2 device or is open.
test_helper_refusals() {
	local img pid
	trap u_cleanup EXIT
	u_newdir refuse || return 1
	img=$PWD/a.qcow2
	must qemu-img create -q -f qcow2 "$img" 16M || return 1
	must truncate -s 16M raw.img || return 1
	expect_msg "no-such.qcow2: no such file" "$QD" create ux no-such.qcow2 ||
		return 1
	expect_msg "no such file" "$QD" table "$PWD/no-such.qcow2" || return 1
	expect_msg "is a raw image, not qcow2" "$QD" create ux raw.img || return 1
	dmsetup info ux >/dev/null 2>&1 && fail "ux was created" && return 1

	# In use by a dm-qcow2 device: refused for writing and read-only
	must "$QD" create ua "$img" || return 1
	expect_msg "is in use: device-mapper device ua serves it" \
		"$QD" create ux "$img" || return 1
	expect_msg "is in use: device-mapper device ua serves it" \
		"$QD" create ux "$img" --readonly || return 1
	# ... and a device that is open cannot be removed
	sleep 30 7<>/dev/mapper/ua &
	pid=$!
	expect_msg "cannot remove ua" "$QD" remove ua || { kill $pid; return 1; }
	kill $pid
	wait $pid 2>/dev/null
	must "$QD" remove ua || return 1

	# In use by a loop device, by a process
	local loop
	loop=$(losetup -f --show "$img") || fail "losetup" || return 1
	expect_msg "loop device $loop is attached" "$QD" create ux "$img" ||
		{ losetup -d "$loop"; return 1; }
	losetup -d "$loop"
	sleep 30 7<"$img" &
	pid=$!
	expect_msg "is in use: open by process" "$QD" create ux "$img" ||
		{ kill $pid; return 1; }
	kill $pid
	wait $pid 2>/dev/null

	# Not a qcow2 device, no device at all
	must dmsetup create uz --table "0 8 zero" || return 1
	expect_msg "uz is not a qcow2 device" "$QD" remove uz || return 1
	must dmsetup remove uz || return 1
	expect_msg "no device-mapper device named uz" "$QD" remove uz || return 1
	# Bad arguments are usage errors (2)
	"$QD" create ux >/dev/null 2>&1
	[ $? -eq 2 ] || fail "create without an image did not exit 2" || return 1
	"$QD" table "$img" --cache-size 12q >/dev/null 2>&1
	[ $? -eq 1 ] || fail "a bad cache size was accepted" || return 1
	dmsetup info ux >/dev/null 2>&1 && fail "ux was created" && return 1
	u_check "$img"
}

# json_field FIELD: FIELD of the JSON object on stdin ("-" for null)
json_field() {
	python3 -c 'import json, sys
v = json.load(sys.stdin)[sys.argv[1]]
print("-" if v is None else str(v).lower() if isinstance(v, bool) else v)' "$1"
}

# Managing devices: the QCOW2- uuid, list and status (text and JSON) with
# the kernel's counters, resize growing the image of a device in use (and
# what it refuses), a snapshot served read-only at its own size.
test_helper_manage() {
	local img out js
	trap u_cleanup EXIT
	u_newdir manage || return 1
	img=$PWD/m.qcow2
	must qemu-img create -q -f qcow2 "$img" 64M || return 1
	must qemu-io -f qcow2 -c "write -P 0x31 0 1M" "$img" || return 1
	must qemu-img snapshot -c snap1 "$img" || return 1
	must "$QD" create um "$img" || return 1
	[ "$(dmsetup info -c --noheadings -o uuid um)" = QCOW2-um ] ||
		fail "uuid '$(dmsetup info -c --noheadings -o uuid um)'" || return 1
	must qemu-io -f raw -c "write -P 0x32 1M 1M" /dev/mapper/um || return 1

	out=$("$QD" list) || fail "list failed" || return 1
	log "list: ${out//$'\n'/ | }"
	echo "$out" | grep -Eq "^um +$img +- +rw +64.0M +2.[0-9]M\$" ||
		fail "list: $out" || return 1
	js=$("$QD" status um --json) || fail "status --json failed" || return 1
	[ "$(json_field mode <<<"$js")" = rw ] &&
		[ "$(json_field size <<<"$js")" = $((64 << 20)) ] &&
		[ "$(json_field health <<<"$js")" = ok ] &&
		[ "$(json_field image <<<"$js")" = "$img" ] &&
		[ "$(json_field allocated_clusters <<<"$js")" -ge 32 ] ||
		fail "status --json: $js" || return 1
	out=$("$QD" status um) || fail "status failed" || return 1
	case $out in
	"/dev/mapper/um is active and is not in use."*"mode:"*rw*"cluster_size:"*65536*) ;;
	*) fail "status: $out"; return 1 ;;
	esac
	[ "$("$QD" list --json | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))')" = 1 ] ||
		fail "list --json" || return 1

	# resize: in use (open by a process), refusals first
	sleep 60 7<>/dev/mapper/um &
	local pid=$!
	expect_msg "shrinking is not supported" "$QD" resize um 32M ||
		{ kill $pid; return 1; }
	expect_msg "not a whole number of 512-byte sectors" \
		"$QD" resize um 67109000 || { kill $pid; return 1; }
	expect_msg "size 12q" "$QD" resize um 12q || { kill $pid; return 1; }
	must "$QD" resize um 96M || { kill $pid; return 1; }
	must "$QD" resize um +32M || { kill $pid; return 1; }
	kill $pid
	wait $pid 2>/dev/null
	[ "$(blockdev --getsize64 /dev/mapper/um)" = $((128 << 20)) ] ||
		fail "size after resize $(blockdev --getsize64 /dev/mapper/um)" ||
		return 1
	case " $(dmsetup table um) " in
	*" grow "*) ;;
	*) fail "no grow in the table: $(dmsetup table um)"; return 1 ;;
	esac
	must qemu-io -f raw -c "write -P 0x33 $((128 * 1048576 - 4096)) 4k" \
		/dev/mapper/um || return 1
	must "$QD" remove um || return 1
	[ "$(qemu-img info --output=json "$img" | json_field virtual-size)" = \
		$((128 << 20)) ] || fail "qemu sees another size" || return 1
	u_check "$img" || return 1
	must qemu-io -r -f qcow2 -c "read -P 0x31 0 1M" -c "read -P 0x32 1M 1M" \
		-c "read -P 0x33 $((128 * 1048576 - 4096)) 4k" \
		-c "read -P 0 64M 1M" "$img" || return 1

	# A snapshot: read-only at its own size, as qemu reads it; no resize
	must "$QD" create us "$img" --snapshot snap1 || return 1
	dmsetup info us | grep -q '^State:.*READ-ONLY' ||
		fail "the snapshot device is writable" || return 1
	[ "$(blockdev --getsize64 /dev/mapper/us)" = $((64 << 20)) ] ||
		fail "snapshot size $(blockdev --getsize64 /dev/mapper/us)" ||
		return 1
	must qemu-img convert -U -O raw -l snapshot.name=snap1 "$img" s.raw ||
		return 1
	# qemu-img convert -l reads it at the current size, zeros past its own
	must cmp -n $((64 << 20)) s.raw /dev/mapper/us || return 1
	[ "$("$QD" status us --json | json_field snapshot)" = snap1 ] ||
		fail "status does not name the snapshot" || return 1
	expect_msg "us is read-only" "$QD" resize us 1G || return 1
	must "$QD" remove us || return 1
	expect_msg 'no snapshot "nosuch"' "$QD" create us "$img" \
		--snapshot nosuch || return 1
	expect_msg "no device-mapper device named us" "$QD" status us || return 1
	must dmsetup create uz --table "0 8 zero" || return 1
	expect_msg "uz is not a qcow2 device" "$QD" resize uz 1M || return 1
	must dmsetup remove uz || return 1
	u_check "$img"
}

# A backing chain (raw base, qcow2 middle, qcow2 top): the table names it
# nearest first. Until the target serves chains, create must fail and show
# the kernel's reason; once it does, the device must read as qemu does.
test_helper_chain() {
	local out want
	trap u_cleanup EXIT
	u_newdir chain || return 1
	must truncate -s 32M base.raw || return 1
	must qemu-io -f raw -c "write -P 0x11 0 8M" base.raw || return 1
	must qemu-img create -q -f qcow2 -b base.raw -F raw mid.qcow2 || return 1
	must qemu-io -f qcow2 -c "write -P 0x22 4M 8M" mid.qcow2 || return 1
	must qemu-img create -q -f qcow2 -b mid.qcow2 -F qcow2 top.qcow2 ||
		return 1
	want="0 65536 qcow2 $PWD/top.qcow2 6 backing $PWD/mid.qcow2"
	want="$want backing $PWD/base.raw cache_size 1m"
	out=$("$QD" table top.qcow2 --cache-size 1m)
	[ "$out" = "$want" ] || fail "table '$out', want '$want'" || return 1
	# The chain named by hand: the same table; a wrong one is the
	# kernel's to refuse, with its reason shown
	out=$("$QD" table top.qcow2 --backing mid.qcow2 --backing base.raw \
		--cache-size 1m)
	[ "$out" = "$want" ] || fail "table with --backing '$out'" || return 1
	expect_msg "kernel: device-mapper: table:" "$QD" create ux top.qcow2 \
		--readonly --backing base.raw || return 1
	dmsetup info ux >/dev/null 2>&1 && fail "ux was created" && return 1
	# A missing backing file is reported by name
	must mv base.raw base.moved || return 1
	expect_msg "base.raw" "$QD" table top.qcow2 || return 1
	must mv base.moved base.raw || return 1

	if out=$("$QD" create uch top.qcow2 --readonly 2>&1); then
		log "the target serves the chain"
		must qemu-img compare -U -f raw -F qcow2 /dev/mapper/uch top.qcow2 ||
			return 1
		must "$QD" remove uch || return 1
	else
		case $out in
		*"kernel refused the table"*"kernel: "*qcow2:*) ;;
		*) fail "no kernel reason shown: $out"; return 1 ;;
		esac
		log "${out//$'\n'/ | }"
	fi
	# A backing image that another device writes is not used
	must qemu-img create -q -f qcow2 b2.qcow2 32M || return 1
	must qemu-img create -q -f qcow2 -b b2.qcow2 -F qcow2 t2.qcow2 || return 1
	must "$QD" create ub2 b2.qcow2 || return 1
	expect_msg "backing image $PWD/b2.qcow2 is in use" \
		"$QD" create ux t2.qcow2 --readonly || return 1
	must "$QD" remove ub2 || return 1
}

# ---- LVM ----------------------------------------------------------------------

# LVM on a dm-qcow2 device: PV, VG, LV, ext4 with files; after removal the
# image is clean, qemu reads the same volume group out of it, and a new
# device over it activates the VG with the file system intact.
test_lvm_on_qcow2() {
	local img mnt=$SCRATCH/umnt
	trap u_cleanup EXIT
	U_VGS=(uvg)
	u_newdir lvm || return 1
	img=$PWD/pv.qcow2
	must qemu-img create -q -f qcow2 -o cluster_size=64k "$img" 512M ||
		return 1
	must "$QD" create upv "$img" || return 1
	must lvm_ pvcreate -y /dev/mapper/upv || return 1
	must lvm_ vgcreate uvg /dev/mapper/upv || return 1
	must lvm_ lvcreate -y -L 200M -n lv uvg || return 1
	[ -b /dev/uvg/lv ] || fail "no /dev/uvg/lv" || return 1
	must mkfs.ext4 -q /dev/uvg/lv || return 1
	mkdir -p "$mnt" && must mount /dev/uvg/lv "$mnt" || return 1
	must mkdir -p "$mnt/d/e" || return 1
	must dd if=/dev/urandom of="$mnt/big" bs=1M count=24 status=none ||
		return 1
	must dd if=/dev/urandom of="$mnt/d/e/small" bs=1k count=37 status=none ||
		return 1
	seq 100000 >"$mnt/d/seq" || return 1
	(cd "$mnt" && find . -type f -exec sha256sum {} + | sort -k 2) >sums ||
		return 1
	must umount "$mnt" || return 1
	must lvm_ vgchange -an uvg || return 1
	must "$QD" remove upv || return 1
	u_check "$img" || return 1

	# qemu's view of the image: the same volume group and files
	local loop
	must qemu-img convert -O raw "$img" pv.raw || return 1
	loop=$(losetup -f --show -r pv.raw) || fail "losetup" || return 1
	must lvm_ vgchange -ay uvg || return 1
	must fsck.ext4 -n -f /dev/uvg/lv || return 1
	must mount -o ro /dev/uvg/lv "$mnt" || return 1
	(cd "$mnt" && sha256sum --quiet -c "$SCRATCH/lvm/sums") >&2 ||
		fail "files differ in qemu's copy" || return 1
	must umount "$mnt" || return 1
	must lvm_ vgchange -an uvg || return 1
	must losetup -d "$loop" || return 1
	rm -f pv.raw

	# The device again: the VG activates, the file system is clean
	must "$QD" create upv "$img" || return 1
	must lvm_ vgchange -ay uvg || return 1
	must fsck.ext4 -n -f /dev/uvg/lv || return 1
	must mount /dev/uvg/lv "$mnt" || return 1
	(cd "$mnt" && sha256sum --quiet -c "$SCRATCH/lvm/sums") >&2 ||
		fail "files differ after re-creation" || return 1
	must umount "$mnt" || return 1
	must lvm_ vgchange -an uvg || return 1
	must "$QD" remove upv || return 1
	u_check "$img"
}

# A qcow2 image made by qemu-img directly on an LVM logical volume, served
# through the block-device backend: written, removed, checked clean, and
# read back by qemu identical to what the device showed.
test_qcow2_on_lv() {
	local loop img=/dev/ulvg/img
	trap u_cleanup EXIT
	U_VGS=(ulvg)
	u_newdir onlv || return 1
	must truncate -s 1G pv.raw || return 1
	loop=$(losetup -f --show pv.raw) || fail "losetup" || return 1
	must lvm_ pvcreate -y "$loop" || return 1
	must lvm_ vgcreate ulvg "$loop" || return 1
	must lvm_ lvcreate -y -L 320M -n img ulvg || return 1
	must qemu-img create -q -f qcow2 "$img" 256M || return 1
	[ "$("$QD" table "$img")" = "0 524288 qcow2 $img" ] ||
		fail "table '$("$QD" table "$img")'" || return 1
	must "$QD" create uimg "$img" || return 1
	# The device holds the LV: a second user is refused
	expect_msg "is in use" "$QD" create ux "$img" || return 1
	must qemu-io -f raw -c "write -P 0x3c 0 1M" -c "write -P 0xc3 100M 5M" \
		-c "write -P 0x5a $((256 * 1024 * 1024 - 4096)) 4096" \
		/dev/mapper/uimg || return 1
	must dd if=/dev/urandom of=/dev/mapper/uimg bs=64k count=160 \
		seek=2000 oflag=direct conv=fsync status=none || return 1
	must dd if=/dev/mapper/uimg of=ref.raw bs=1M iflag=direct status=none ||
		return 1
	must "$QD" remove uimg || return 1
	u_check "$img" || return 1
	must qemu-img compare -U -f raw -F qcow2 ref.raw "$img" || return 1
	must lvm_ vgchange -an ulvg || return 1
	must losetup -d "$loop"
}

# The smallest stack showing what qcow2_on_lv needs from the block-device
# backend: an image made by qemu-img on a file, a loop device over it, a
# dm-linear device over the loop device, the target over the linear device.
# (The target reads header fields with sub-sector bios; a loop device
# serves them, a bio-based device-mapper device in between does not.)
test_bdev_dm_linear() {
	local loop sectors
	trap u_cleanup EXIT
	u_newdir lin || return 1
	must qemu-img create -q -f qcow2 a.qcow2 64M || return 1
	must qemu-io -f qcow2 -c "write -P 0x77 1M 1M" a.qcow2 || return 1
	loop=$(losetup -f --show a.qcow2) || fail "losetup" || return 1
	sectors=$(blockdev --getsz "$loop")
	must dmsetup create ulin --table "0 $sectors linear $loop 0" || return 1
	must dmsetup mknodes ulin || return 1
	must "$QD" create uq /dev/mapper/ulin --readonly || return 1
	must qemu-io -r -f raw -c "read -P 0x77 1M 1M" -c "read -P 0 0 1M" \
		/dev/mapper/uq || return 1
	must "$QD" remove uq || return 1
	must dmsetup remove ulin
}
