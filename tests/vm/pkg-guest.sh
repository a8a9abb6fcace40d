#!/bin/bash
# Guest side of "scripts/pkg-check install": the packages installed on a
# fresh Debian 12 root (the disk with serial drive0, see pkg-check), in a
# chroot, on the kernel this guest booted. Nothing of the source tree is
# used but the two .deb files.
# Usage: tests/vm/pkg-guest.sh PKG_DIR   (the dir with the .deb files)
set -uo pipefail

pkgs=$1
r=/tmp/pkgroot
kv=$(uname -r)
passed=0
failed=0

check() {
	local name=$1
	shift
	echo "--- $name"
	if "$@"; then
		echo "PASS $name"
		passed=$((passed + 1))
	else
		echo "FAIL $name"
		failed=$((failed + 1))
	fi
}

in_root() { chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
	HOME=/root DEBIAN_FRONTEND=noninteractive "$@"; }

dev=
for s in /sys/block/vd*/serial; do
	[ "$(cat "$s")" = drive0 ] && dev=/dev/$(basename "$(dirname "$s")")
done
[ -n "$dev" ] || { echo "no root disk (serial drive0)"; exit 1; }

setup() {
	mkdir -p "$r" && mount "$dev" "$r" || return 1
	# The guest kernel's modules: the host's tree, read-only, with what
	# DKMS and depmod write above it.
	mkdir -p /tmp/mods-up /tmp/mods-work "$r/lib/modules" &&
		mount -t overlay overlay -o \
			"lowerdir=/lib/modules,upperdir=/tmp/mods-up,workdir=/tmp/mods-work" \
			"$r/lib/modules" || return 1
	mount -t proc proc "$r/proc" && mount -t sysfs sysfs "$r/sys" &&
		mount --bind /dev "$r/dev" || return 1
	mkdir -p "$r/tmp/debs" && cp "$pkgs"/*.deb "$r/tmp/debs/"
}

install_debs() {
	in_root sh -c 'cd /tmp/debs && apt-get install -y --no-install-recommends ./dm-qcow2-dkms_*.deb ./dm-qcow2-tools_*.deb' || return 1
	in_root dkms status
	in_root dkms status dm-qcow2 | grep "$kv.*installed"
}

load() {
	in_root modprobe dm-qcow2 && grep -q '^dm_qcow2 ' /proc/modules &&
		in_root modinfo -F version dm-qcow2
}

serve() {
	in_root qemu-img create -q -f qcow2 /tmp/a.qcow2 256M &&
		in_root qemu-io -f qcow2 -c 'write -P 0x5a 1M 1M' /tmp/a.qcow2 >/dev/null &&
		in_root qcow2-dmsetup create pkgt /tmp/a.qcow2 || return 1
	# the MiB qemu-io wrote: 0x5a ("Z") and nothing else
	[ "$(in_root sh -c 'dd if=/dev/mapper/pkgt bs=1M skip=1 count=1 status=none |
		tr -d Z | wc -c')" = 0 ] || return 1
	in_root dd if=/dev/urandom of=/dev/mapper/pkgt bs=1M seek=8 count=4 oflag=direct status=none &&
		in_root qcow2-dmsetup remove pkgt &&
		in_root qemu-img check /tmp/a.qcow2 &&
		in_root test -f /usr/share/man/man8/qcow2-dmsetup.8.gz
}

check setup setup
check "install on $kv" install_debs
check "modprobe on $kv" load
check "qcow2-dmsetup on $kv" serve
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
