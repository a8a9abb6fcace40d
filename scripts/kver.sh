#!/bin/bash
# Print the guest kernel version to boot and build for: the distribution's
# default kernel (the one the linux-image-amd64 package depends on) when it
# has modules (/lib/modules/<ver>/kernel) and headers (/lib/modules/<ver>/build
# or /usr/src/linux-headers-<ver>), else the newest /boot/vmlinuz-*-amd64 that
# has both. Installing another kernel (6.12 on Debian 12) does not change what
# the tests run on; select it with QCOW2_KVER=<ver>, or QCOW2_KVER=<series>
# (6.12: the kernel the linux-image-6.12-amd64 package depends on).
set -euo pipefail

# meta_dep PACKAGE: the release its "linux-image-<release> (= ...)" names.
meta_dep() {
	dpkg-query -W -f='${Depends}' "$1" 2>/dev/null |
		sed -n 's/^linux-image-\([^ ,]*\).*/\1/p'
}

usable() {
	[ -e "/boot/vmlinuz-$1" ] && [ -d "/lib/modules/$1/kernel" ] &&
		{ [ -d "/lib/modules/$1/build" ] || [ -d "/usr/src/linux-headers-$1" ]; }
}

# newest [PREFIX]: the newest usable /boot/vmlinuz-PREFIX*-amd64.
newest() {
	local f v
	for f in /boot/vmlinuz-"$1"*-amd64; do
		[ ! -e "$f" ] || echo "${f#/boot/vmlinuz-}"
	done | sort -rV | while IFS= read -r v; do
		usable "$v" && { echo "$v"; break; }
	done || true
}

if [[ ${QCOW2_KVER:-} =~ ^[0-9]+\.[0-9]+$ ]]; then
	v=$(meta_dep "linux-image-$QCOW2_KVER-amd64") || v=
	{ [ -n "$v" ] && usable "$v"; } || v=$(newest "$QCOW2_KVER.")
	[ -n "$v" ] || {
		echo "kver.sh: no usable $QCOW2_KVER kernel (linux-image-$QCOW2_KVER-amd64 and its headers)" >&2
		exit 1
	}
	QCOW2_KVER=$v
fi

if [ -n "${QCOW2_KVER:-}" ]; then
	[ -e "/boot/vmlinuz-$QCOW2_KVER" ] ||
		echo "kver.sh: warning: /boot/vmlinuz-$QCOW2_KVER not found" >&2
	echo "$QCOW2_KVER"
	exit 0
fi

def=$(meta_dep linux-image-amd64) || def=
if [ -n "$def" ] && usable "$def"; then
	echo "$def"
	exit 0
fi

v=$(newest "")
if [ -n "$v" ]; then
	echo "$v"
	exit 0
fi

echo "kver.sh: no usable /boot/vmlinuz-*-amd64 with modules and headers" \
	"(run scripts/deps.sh)" >&2
exit 1
