#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
#
# Cross-check the dm-qcow2 header parser against images made by qemu-img.
#
#   real-images.sh QCOW2_DUMP
#
# For each image variant: qemu-img creates it, qemu-io writes a little data,
# QCOW2_DUMP (tests/unit/qcow2-dump) must accept it, and the fields it prints
# must agree with `qemu-img info --output=json`. Prints PASS/FAIL per image
# and ends with "N passed, N failed"; exits non-zero on any failure.

set -u

dump=$(realpath "${1:?usage: $0 QCOW2_DUMP}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0

# Value of KEY in the key=value output in $tmp/dump.txt
field() {
	sed -n "s/^$1=//p" "$tmp/dump.txt"
}

# Value of a jq path in $tmp/info.json
info() {
	jq -r "$1" "$tmp/info.json"
}

# expect NAME OURS THEIRS: record a mismatch in $problems
expect() {
	if [ "$2" != "$3" ]; then
		problems+="$1: ours '$2', qemu-img '$3'; "
	fi
}

# l2_bits follows from cluster_bits and the L2 entry width (8 or 16 bytes)
expected_l2_bits() {
	local bits=$1 ext=$2
	if [ "$ext" = true ]; then echo $((bits - 4)); else echo $((bits - 3)); fi
}

compare() {
	local img=$1 cbits ext

	expect cluster_size "$(field cluster_size)" "$(info '."cluster-size"')"
	expect size "$(field size)" "$(info '."virtual-size"')"
	expect compat "$(field compat)" "$(info '."format-specific".data.compat')"
	expect refcount_bits "$(field refcount_bits)" \
		"$(info '."format-specific".data."refcount-bits"')"
	expect lazy_refcounts "$(field lazy_refcounts)" \
		"$(info 'if ."format-specific".data."lazy-refcounts" then 1 else 0 end')"
	expect dirty "$(field dirty)" \
		"$(info 'if ."dirty-flag" then 1 else 0 end')"
	# compat=0.10 images report neither field: treat them as off/zlib
	ext=$(info '."format-specific".data."extended-l2" // false')
	expect extended_l2 "$(field extended_l2)" \
		"$([ "$ext" = true ] && echo 1 || echo 0)"
	expect compression_type "$(field compression_type)" \
		"$(info 'if ."format-specific".data."compression-type" == "zstd" then 1 else 0 end')"
	expect backing_file "$(field backing_file)" \
		"$(info '."backing-filename" // ""')"
	expect backing_format "$(field backing_format)" \
		"$(info '."backing-filename-format" // ""')"
	cbits=$(field cluster_bits)
	expect l2_bits "$(field l2_bits)" "$(expected_l2_bits "$cbits" "$ext")"
	if grep -q ' error=' "$tmp/tables.txt"; then
		problems+="table entries refused: $(grep ' error=' "$tmp/tables.txt" | head -1); "
	fi
}

# check NAME SIZE [qemu-img create arguments...]
check() {
	local name=$1 size=$2 img="$tmp/$1.qcow2"
	shift 2
	problems=
	if ! qemu-img create -q -f qcow2 "$@" "$img" "$size" ||
	   { [ "$size" != 0 ] &&
	     ! qemu-io -f qcow2 -c 'write -q -P 0xab 0 128k' \
		     -c 'write -q -P 0xcd 1M 4k' "$img" >/dev/null; }; then
		echo "FAIL $name: qemu-img/qemu-io could not make the image"
		failed=$((failed + 1))
		return
	fi
	qemu-img info --output=json "$img" >"$tmp/info.json"
	if ! "$dump" "$img" >"$tmp/dump.txt"; then
		echo "FAIL $name: refused: $(field error)"
		failed=$((failed + 1))
		return
	fi
	"$dump" -t "$img" >"$tmp/tables.txt"
	compare "$img"
	if [ -n "$problems" ]; then
		echo "FAIL $name: $problems"
		failed=$((failed + 1))
	else
		echo "PASS $name"
		passed=$((passed + 1))
	fi
}

qemu-img create -q -f raw "$tmp/base.raw" 64M

check compat-0.10	1G	-o compat=0.10
check compat-1.1	1G	-o compat=1.1
check v2-cluster-512	1G	-o compat=0.10,cluster_size=512
check cluster-512	1G	-o cluster_size=512
check cluster-512-64G	64G	-o cluster_size=512
check cluster-4k	1G	-o cluster_size=4k
check cluster-64k	1G	-o cluster_size=64k
check cluster-2M	1G	-o cluster_size=2M
check cluster-2M-1P	1P	-o cluster_size=2M
check refcount-1	1G	-o refcount_bits=1
check refcount-16	1G	-o refcount_bits=16
check refcount-64	1G	-o refcount_bits=64
check refcount-1-c2M	1G	-o refcount_bits=1,cluster_size=2M
check extended-l2	1G	-o extended_l2=on,cluster_size=64k
check extended-l2-16k	1G	-o extended_l2=on,cluster_size=16k
check extended-l2-2M	1G	-o extended_l2=on,cluster_size=2M
check zstd		1G	-o compression_type=zstd
check lazy-refcounts	1G	-o lazy_refcounts=on
check backing		64M	-b "$tmp/base.raw" -F raw
check v2-backing	64M	-o compat=0.10 -b "$tmp/base.raw" -F raw
check odd-size		12345678 -o cluster_size=4k
check size-0		0
check v2-size-0		0	-o compat=0.10
check prealloc-metadata	256M	-o preallocation=metadata

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
