#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
#
# Seed corpus for fuzz-image: real images made by qemu-img/qemu-io in many
# shapes, cut to their first clusters (where the header, refcount table,
# refcount block, L1 and first L2 tables lie), plus the malformed headers
# of tests/images/bad-headers.sh cut the same way.
#
#   make-seeds.sh OUTDIR
#
# Deterministic for a given qemu-img version; nothing here is committed.
set -eu

out=${1:?usage: $0 OUTDIR}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"

# keep NAME IMG: the first 8 clusters of IMG, at most 512 KiB
keep() {
	local cs n
	cs=$(qemu-img info --output=json "$2" |
		python3 -c 'import json,sys; print(json.load(sys.stdin)["cluster-size"])')
	n=$((8 * cs))
	[ "$n" -le $((512 << 10)) ] || n=$((512 << 10))
	head -c "$n" "$2" >"$out/$1"
}

# img NAME OPTIONS SIZE [qemu-io commands...]: make, write, keep
img() {
	local name=$1 opts=$2 size=$3 f=$tmp/$1.qcow2 c args=()
	shift 3
	qemu-img create -q -f qcow2 -o "$opts" "$f" "$size"
	for c; do
		args+=(-c "$c")
	done
	[ $# -eq 0 ] || qemu-io -f qcow2 "${args[@]}" "$f" >/dev/null
	keep "$name" "$f"
}

W=("write -P 0x11 0 4k" "write -P 0x22 1M 64k" "write -z 3M 128k")

for cs in 512 4k 64k; do
	img "v2-c$cs" "compat=0.10,cluster_size=$cs" 16M "${W[@]}"
	img "v3-c$cs" "compat=1.1,cluster_size=$cs" 16M "${W[@]}"
done
img v3-c2m compat=1.1,cluster_size=2M 64M "write -P 0x33 0 4k"
for rb in 1 2 4 8 16 32 64; do
	img "v3-rb$rb" "refcount_bits=$rb,cluster_size=4k" 8M "${W[@]}"
done
img lazy "lazy_refcounts=on,cluster_size=4k" 8M "${W[@]}"
img extl2-64k "extended_l2=on,cluster_size=64k" 16M \
	"write -P 0x44 0 4k" "write -P 0x55 100k 8k" "write -z 1M 64k"
img extl2-16k "extended_l2=on,cluster_size=16k" 4M "write -P 0x44 4k 2k"
img zstd "compression_type=zstd,cluster_size=4k" 4M \
	"write -c -P 0x66 0 4k" "write -P 0x67 8k 4k"
img prealloc "preallocation=metadata,cluster_size=4k" 4M
img empty "cluster_size=4k" 1G

# Compressed clusters (deflate)
qemu-img create -q -f qcow2 -o cluster_size=4k "$tmp/c.qcow2" 4M
qemu-io -f qcow2 -c "write -c -P 0x77 0 4k" -c "write -c -P 0x78 64k 4k" \
	-c "write -P 0x79 128k 4k" "$tmp/c.qcow2" >/dev/null
keep compressed "$tmp/c.qcow2"

# Snapshots: shared clusters (refcount 2), a second L1, a snapshot table
qemu-img create -q -f qcow2 -o cluster_size=4k "$tmp/s.qcow2" 4M
qemu-io -f qcow2 -c "write -P 0x88 0 8k" "$tmp/s.qcow2" >/dev/null
qemu-img snapshot -c snap1 "$tmp/s.qcow2"
qemu-io -f qcow2 -c "write -P 0x89 4k 4k" "$tmp/s.qcow2" >/dev/null
qemu-img snapshot -c snap2 "$tmp/s.qcow2"
keep snapshots "$tmp/s.qcow2"

# A backing file and its format extension
qemu-img create -q -f raw "$tmp/base.raw" 4M
qemu-img create -q -f qcow2 -o cluster_size=4k -b "$tmp/base.raw" -F raw \
	"$tmp/b.qcow2"
qemu-io -f qcow2 -c "write -P 0x99 0 4k" "$tmp/b.qcow2" >/dev/null
keep backing "$tmp/b.qcow2"

# Bitmaps extension (autoclear bit)
qemu-img create -q -f qcow2 -o cluster_size=4k "$tmp/bm.qcow2" 4M
qemu-img bitmap --add "$tmp/bm.qcow2" bm0
keep bitmaps "$tmp/bm.qcow2"

# The malformed headers, each cut like the rest
"$here/../images/bad-headers.sh" "$tmp/bad" >/dev/null
for f in "$tmp"/bad/*.qcow2; do
	head -c $((6 << 16)) "$f" >"$out/bad-$(basename "$f" .qcow2)"
done
ls "$out" | wc -l
