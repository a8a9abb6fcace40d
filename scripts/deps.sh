#!/bin/bash
# Install the host packages needed to build and test dm-qcow2 (Debian).
# Usage: scripts/deps.sh [EXTRA_PACKAGE...]
# Idempotent: apt is only invoked when something is missing.
set -euo pipefail

# Packages needed by the build and the VM test harness (scripts/vm-run).
# qemu-system-x86 pulls seabios and ipxe-qemu as hard dependencies, so
# --no-install-recommends is enough for booting with -kernel.
# linux-image-6.12-amd64: Debian 12's second kernel, which CI builds for and
# boots a core set of guest cases on (scripts/kver.sh, QCOW2_KVER=6.12).
# debhelper, dh-dkms, lintian: the packages (debian/, scripts/pkg-check).
# nfs-kernel-server: the NFS server and client tools the guest runs for
# the images-on-NFS cases (tests/vm/nfs-lib.sh).
# debootstrap: the Debian 12 roots of scripts/distro-test and pkg-check.
PACKAGES="build-essential qemu-system-x86 qemu-utils linux-image-amd64
linux-headers-amd64 linux-image-6.12-amd64 linux-headers-6.12-amd64
busybox-static fio kmod cpio e2fsprogs xfsprogs lvm2 dmsetup util-linux
python3 sparse linux-source-6.1 gnuplot-nox dkms psmisc clang debhelper
dh-dkms lintian nfs-kernel-server debootstrap"

missing=()
for p in $PACKAGES "$@"; do
	# dpkg -s also succeeds for removed-but-configured packages; check status.
	status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
	[ "$status" = "install ok installed" ] || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
	echo "deps.sh: all packages installed"
	exit 0
fi

sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)

echo "deps.sh: installing: ${missing[*]}"
"${sudo[@]}" apt-get update
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
	apt-get install -y --no-install-recommends "${missing[@]}"
