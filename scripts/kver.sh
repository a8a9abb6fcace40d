#!/bin/bash
# Print the guest kernel version to boot and build for: the distribution's
# default kernel (the one the linux-image-amd64 package depends on) when it
# has modules (/lib/modules/<ver>/kernel) and headers (/lib/modules/<ver>/build
# or /usr/src/linux-headers-<ver>), else the newest /boot/vmlinuz-*-amd64 that
# has both. Installing another kernel (6.12 on Debian 12) does not change what
# the tests run on; select it with QCOW2_KVER=<ver>.
set -euo pipefail

if [ -n "${QCOW2_KVER:-}" ]; then
	[ -e "/boot/vmlinuz-$QCOW2_KVER" ] ||
		echo "kver.sh: warning: /boot/vmlinuz-$QCOW2_KVER not found" >&2
	echo "$QCOW2_KVER"
	exit 0
fi

usable() {
	[ -e "/boot/vmlinuz-$1" ] && [ -d "/lib/modules/$1/kernel" ] &&
		{ [ -d "/lib/modules/$1/build" ] || [ -d "/usr/src/linux-headers-$1" ]; }
}

# linux-image-amd64 depends on "linux-image-<ver> (= ...)"
def=$(dpkg-query -W -f='${Depends}' linux-image-amd64 2>/dev/null |
	sed -n 's/^linux-image-\([^ ,]*\).*/\1/p') || def=
if [ -n "$def" ] && usable "$def"; then
	echo "$def"
	exit 0
fi

shopt -s nullglob
vers=()
for f in /boot/vmlinuz-*-amd64; do vers+=("${f#/boot/vmlinuz-}"); done

if [ ${#vers[@]} -gt 0 ]; then
	while IFS= read -r v; do
		usable "$v" || continue
		echo "$v"
		exit 0
	done < <(printf '%s\n' "${vers[@]}" | sort -rV)
fi

echo "kver.sh: no usable /boot/vmlinuz-*-amd64 with modules and headers" \
	"(run scripts/deps.sh)" >&2
exit 1
