#!/bin/bash
# Print the guest kernel version to boot: the newest /boot/vmlinuz-*-amd64
# that has modules (/lib/modules/<ver>/kernel) and headers
# (/lib/modules/<ver>/build or /usr/src/linux-headers-<ver>).
# Override with QCOW2_KVER=<ver>.
set -euo pipefail

if [ -n "${QCOW2_KVER:-}" ]; then
	[ -e "/boot/vmlinuz-$QCOW2_KVER" ] ||
		echo "kver.sh: warning: /boot/vmlinuz-$QCOW2_KVER not found" >&2
	echo "$QCOW2_KVER"
	exit 0
fi

shopt -s nullglob
vers=()
for f in /boot/vmlinuz-*-amd64; do vers+=("${f#/boot/vmlinuz-}"); done

if [ ${#vers[@]} -gt 0 ]; then
	while IFS= read -r v; do
		[ -d "/lib/modules/$v/kernel" ] || continue
		[ -d "/lib/modules/$v/build" ] || [ -d "/usr/src/linux-headers-$v" ] || continue
		echo "$v"
		exit 0
	done < <(printf '%s\n' "${vers[@]}" | sort -rV)
fi

echo "kver.sh: no usable /boot/vmlinuz-*-amd64 with modules and headers" \
	"(run scripts/deps.sh)" >&2
exit 1
