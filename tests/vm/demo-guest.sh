#!/bin/bash
# Guest side of scripts/demo: one image, one device, shown step by step.
set -euo pipefail

top=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
show() { echo; echo "# $*"; "$@"; }

mkdir -p /tmp/demo
if [ -b /dev/vda ]; then
	mkfs.ext4 -q /dev/vda && mount /dev/vda /tmp/demo
fi
cd /tmp/demo
modprobe dm-mod
insmod "${QCOW2_KO:-$top/drivers/md/dm-qcow2.ko}"

show qemu-img create -f qcow2 vm0.qcow2 1G
show qemu-io -f qcow2 -c "write -P 0xab 0 4M" -c "write -P 0xcd 512M 1M" \
	-c "write -z 700M 64M" vm0.qcow2
sectors=$(( $(qemu-img info -U --output=json vm0.qcow2 |
	python3 -c 'import json,sys; print(json.load(sys.stdin)["virtual-size"])') / 512 ))
show dmsetup create vm0 --table "0 $sectors qcow2 $PWD/vm0.qcow2"
dmsetup mknodes vm0
show lsblk /dev/mapper/vm0
show dmsetup table vm0
echo; echo "# first bytes at 0 and at 512 MiB, written by qemu-io"
# direct I/O: whole logical blocks (512 bytes), then the first 16 shown
dd if=/dev/mapper/vm0 bs=512 count=1 iflag=direct status=none | od -An -tx1 -N16
dd if=/dev/mapper/vm0 bs=512 count=1 skip=$((512 * 1024 * 1024 / 512)) \
	iflag=direct status=none | od -An -tx1 -N16
show qemu-img compare -U -f raw -F qcow2 /dev/mapper/vm0 vm0.qcow2
echo; echo "# a file system on the device"
show mkfs.ext4 -q /dev/mapper/vm0
mkdir -p /tmp/demo-mnt
mount /dev/mapper/vm0 /tmp/demo-mnt
cp -r "$top/drivers" /tmp/demo-mnt/
show df -h /tmp/demo-mnt
umount /tmp/demo-mnt
show dmsetup status vm0
show dmsetup remove vm0
show qemu-img check vm0.qcow2
show qemu-img info -U vm0.qcow2
