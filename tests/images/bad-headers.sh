#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
#
# Make qcow2 images with one bad header field each, for the dm-qcow2 ctr.
#
#   bad-headers.sh OUTDIR
#	Writes OUTDIR/<case>.qcow2 for every case, plus OUTDIR/expected.tsv:
#	"<case>\t<error>", where <error> is the exact message
#	drivers/md/dm-qcow2-format.c gives for that image.
#
#   bad-headers.sh --verify QCOW2_DUMP [OUTDIR]
#	Also runs QCOW2_DUMP (tests/unit/qcow2-dump) on each image and checks
#	that it refuses it with exactly the expected message (PASS/FAIL per
#	case, "N passed, N failed", non-zero exit on any failure). Then it
#	notes, without failing, each image that `qemu-img info` opens anyway.
#
# Every image starts as the same valid one: qcow2 v3, 64 KiB clusters,
# 64 MiB, some data written. Its layout (as qemu-img 7.x makes it): header
# and extensions in cluster 0 (header_length 112, then the feature name
# table extension at 112), refcount table at 0x10000, refcount block at
# 0x20000, L1 (1 entry) at 0x30000, L2 at 0x40000, data from 0x50000.

set -eu

E_SMALL="Image too small for a qcow2 header"
E_MAGIC="Not a qcow2 image (bad magic)"
E_VERSION="Unsupported qcow2 version (not 2 or 3)"
E_CBITS="Cluster size out of range (cluster_bits not 9..21)"
E_HLEN_SMALL="Header length too small for version 3"
E_HLEN_BIG="Header length larger than one cluster"
E_HLEN_PAST="Header runs past the end of the image"
E_BACK_OFF="Backing file name offset outside the first cluster"
E_BACK_LONG="Backing file name too long (max 1023 bytes)"
E_BACK_PAST="Backing file name runs past the first cluster"
E_INCOMPAT="Unknown incompatible feature bits set"
E_RC_ORDER="Refcount width too large (refcount_order > 6)"
E_CRYPT="Unknown encryption method"
E_COMP_TYPE="Unknown compression type"
E_COMP_NOBIT="Compression type set but incompatible bit 3 clear"
E_COMP_DEFL="Incompatible bit 3 set but compression type is deflate"
E_EXTL2="Extended L2 needs clusters of 16 KiB or more"
E_RT_NONE="Image has no refcount table"
E_RT_BIG="Refcount table too large (max 8 MiB)"
E_RT_ALIGN="Refcount table offset not cluster aligned"
E_RT_OFF="Refcount table offset too large"
E_SN_MANY="Too many snapshots (max 65536)"
E_SN_ALIGN="Snapshot table offset not cluster aligned"
E_SN_OFF="Snapshot table offset too large"
E_L1_BIG="L1 table too large (max 32 MiB)"
E_L1_ALIGN="L1 table offset not cluster aligned"
E_L1_OFF="L1 table offset too large"
E_L1_SMALL="L1 table too small for the virtual size"
E_EXT_PAST="Header extension runs past its area"
E_BFMT_LONG="Backing format extension too long"
E_CRYPTO_NOLUKS="Encryption header extension without LUKS encryption"
E_CRYPTO_LEN="Encryption header extension has a bad length"
E_LUKS_NOEXT="LUKS encryption without its header extension"
E_BITMAPS_LEN="Bitmaps extension has a bad length"
E_LAY_RT_HDR="Refcount table overlaps the header"
E_LAY_RT_END="Refcount table runs past the end of the image"
E_LAY_L1_HDR="L1 table overlaps the header"
E_LAY_L1_END="L1 table runs past the end of the image"
E_LAY_L1_RT="L1 table overlaps the refcount table"

# Header field offsets
OFF_MAGIC=0 OFF_VERSION=4 OFF_BACKING=8 OFF_BACKING_SIZE=16
OFF_CLUSTER_BITS=20 OFF_SIZE=24 OFF_CRYPT=32 OFF_L1_SIZE=36 OFF_L1=40
OFF_REFTABLE=48 OFF_REFTABLE_CLUSTERS=56 OFF_NB_SNAP=60 OFF_SNAP=64
OFF_INCOMPAT=72 OFF_AUTOCLEAR=88 OFF_REFCOUNT_ORDER=96 OFF_HEADER_LEN=100
OFF_COMPRESSION=104 OFF_EXT=112	# the first extension: type, then length

# poke FILE OFFSET HEX: write the bytes spelled by HEX (big-endian) in place
poke() {
	local esc
	# shellcheck disable=SC2001 # sed's & is clearer than bash's patsub
	esc=$(sed 's/../\\x&/g' <<<"$3")
	printf '%b' "$esc" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}

be8()  { printf '%02x' "$1"; }
be32() { printf '%08x' "$1"; }
be64() { printf '%016x' "$1"; }

make_base() {
	qemu-img create -q -f qcow2 -o compat=1.1,cluster_size=64k "$1" 64M
	qemu-io -f qcow2 -c 'write -q -P 0xab 0 128k' \
		-c 'write -q -P 0xcd 32M 64k' "$1" >/dev/null
	# The offsets below rely on qemu-img's layout; refuse to go on if
	# it ever changes.
	[ "$(od -An -tx1 -j "$OFF_HEADER_LEN" -N4 "$1" | tr -d ' ')" = 00000070 ] ||
		{ echo "$0: unexpected header_length in base image" >&2; exit 1; }
	[ "$(od -An -tx1 -j "$OFF_EXT" -N4 "$1" | tr -d ' ')" = 6803f857 ] ||
		{ echo "$0: unexpected first extension in base image" >&2; exit 1; }
}

# bad CASE ERROR [OFFSET HEX]...: copy the base image and poke each pair
bad() {
	local name=$1 err=$2 img="$outdir/$1.qcow2"
	shift 2
	cp "$base" "$img"
	while [ $# -gt 0 ]; do
		poke "$img" "$1" "$2"
		shift 2
	done
	printf '%s\t%s\n' "$name" "$err" >>"$outdir/expected.tsv"
}

# truncated CASE ERROR BYTES: the base image cut to BYTES
truncated() {
	cp "$base" "$outdir/$1.qcow2"
	truncate -s "$3" "$outdir/$1.qcow2"
	printf '%s\t%s\n' "$1" "$2" >>"$outdir/expected.tsv"
}

generate() {
	: >"$outdir/expected.tsv"

	bad bad-magic "$E_MAGIC"		$OFF_MAGIC 514649fa
	bad version-1 "$E_VERSION"		$OFF_VERSION "$(be32 1)"
	bad version-4 "$E_VERSION"		$OFF_VERSION "$(be32 4)"
	bad cluster-bits-8 "$E_CBITS"		$OFF_CLUSTER_BITS "$(be32 8)"
	bad cluster-bits-22 "$E_CBITS"		$OFF_CLUSTER_BITS "$(be32 22)"
	bad header-length-100 "$E_HLEN_SMALL"	$OFF_HEADER_LEN "$(be32 100)"
	bad header-length-too-big "$E_HLEN_BIG"	$OFF_HEADER_LEN "$(be32 65544)"
	bad backing-offset-outside "$E_BACK_OFF" \
		$OFF_BACKING "$(be64 65537)" $OFF_BACKING_SIZE "$(be32 4)"
	bad backing-name-too-long "$E_BACK_LONG" \
		$OFF_BACKING "$(be64 1024)" $OFF_BACKING_SIZE "$(be32 1024)"
	bad backing-name-past-cluster "$E_BACK_PAST" \
		$OFF_BACKING "$(be64 65526)" $OFF_BACKING_SIZE "$(be32 11)"
	bad incompat-bit-5 "$E_INCOMPAT"	$OFF_INCOMPAT "$(be64 0x20)"
	bad incompat-bit-63 "$E_INCOMPAT"	$OFF_INCOMPAT 8000000000000000
	bad refcount-order-7 "$E_RC_ORDER"	$OFF_REFCOUNT_ORDER "$(be32 7)"
	bad crypt-method-3 "$E_CRYPT"		$OFF_CRYPT "$(be32 3)"
	bad compression-type-2 "$E_COMP_TYPE" \
		$OFF_COMPRESSION "$(be8 2)" $OFF_INCOMPAT "$(be64 0x8)"
	bad compression-type-without-bit "$E_COMP_NOBIT" \
		$OFF_COMPRESSION "$(be8 1)"
	bad compression-bit-with-deflate "$E_COMP_DEFL" \
		$OFF_INCOMPAT "$(be64 0x8)"
	bad extended-l2-small-clusters "$E_EXTL2" \
		$OFF_INCOMPAT "$(be64 0x10)" $OFF_CLUSTER_BITS "$(be32 13)"
	bad reftable-clusters-0 "$E_RT_NONE"	$OFF_REFTABLE_CLUSTERS "$(be32 0)"
	bad reftable-too-large "$E_RT_BIG"	$OFF_REFTABLE_CLUSTERS "$(be32 129)"
	bad reftable-misaligned "$E_RT_ALIGN"	$OFF_REFTABLE "$(be64 0x10200)"
	bad reftable-offset-too-large "$E_RT_OFF" \
		$OFF_REFTABLE "$(be64 0x7fffffffffff0000)"
	bad too-many-snapshots "$E_SN_MANY"	$OFF_NB_SNAP "$(be32 65537)"
	bad snapshot-table-misaligned "$E_SN_ALIGN" \
		$OFF_NB_SNAP "$(be32 1)" $OFF_SNAP "$(be64 0x50200)"
	bad snapshot-offset-too-large "$E_SN_OFF" \
		$OFF_NB_SNAP "$(be32 1)" $OFF_SNAP 8000000000000000
	bad l1-too-large "$E_L1_BIG"		$OFF_L1_SIZE "$(be32 4194305)"
	bad l1-misaligned "$E_L1_ALIGN"		$OFF_L1 "$(be64 0x30200)"
	bad l1-offset-too-large "$E_L1_OFF"	$OFF_L1 8000000000000000
	bad l1-too-small "$E_L1_SMALL"		$OFF_SIZE "$(be64 0x20000001)"
	bad size-2-pow-63 "$E_L1_SMALL"		$OFF_SIZE 8000000000000000
	# The feature name table at 112 claims to run past the cluster
	bad extension-past-area "$E_EXT_PAST"	$((OFF_EXT + 4)) "$(be32 65536)"
	# ... or the image ends in the middle of its 8-byte header
	truncated extension-header-truncated "$E_EXT_PAST" 116
	bad backing-format-too-long "$E_BFMT_LONG" \
		$OFF_EXT e2792aca $((OFF_EXT + 4)) "$(be32 16)"
	bad crypto-ext-without-luks "$E_CRYPTO_NOLUKS" \
		$OFF_EXT 0537be77 $((OFF_EXT + 4)) "$(be32 16)"
	bad crypto-ext-bad-length "$E_CRYPTO_LEN" $OFF_CRYPT "$(be32 2)" \
		$OFF_EXT 0537be77 $((OFF_EXT + 4)) "$(be32 8)"
	bad luks-without-crypto-ext "$E_LUKS_NOEXT" $OFF_CRYPT "$(be32 2)"
	bad bitmaps-ext-bad-length "$E_BITMAPS_LEN" $OFF_AUTOCLEAR "$(be64 1)" \
		$OFF_EXT 23852875 $((OFF_EXT + 4)) "$(be32 16)"
	# Layout: the tables against the image itself
	bad l1-past-end "$E_LAY_L1_END"		$OFF_L1 "$(be64 0x10000000)"
	bad l1-overlapping-header "$E_LAY_L1_HDR" $OFF_L1 "$(be64 0)"
	bad reftable-past-end "$E_LAY_RT_END"	$OFF_REFTABLE "$(be64 0x10000000)"
	bad reftable-overlapping-header "$E_LAY_RT_HDR" \
		$OFF_REFTABLE "$(be64 0)"
	bad l1-overlapping-reftable "$E_LAY_L1_RT" $OFF_L1 "$(be64 0x10000)"
	bad reftable-overlapping-l1 "$E_LAY_L1_RT" $OFF_REFTABLE "$(be64 0x30000)"
	truncated truncated-50 "$E_SMALL" 50
	truncated truncated-100 "$E_SMALL" 100
	truncated truncated-header-108 "$E_HLEN_PAST" 108
	# The image ends inside the refcount table / the L1 table
	truncated truncated-in-reftable "$E_LAY_RT_END" $((0x10000 + 4096))
	truncated truncated-in-l1 "$E_LAY_L1_END" $((0x30000 + 4))
}

# verify DUMP: every image must be refused with exactly its message
verify() {
	local dump=$1 name want got rc passed=0 failed=0 qemu_ok=() qemu_crash=()

	if ! "$dump" "$base" >/dev/null; then
		echo "FAIL base-image: $("$dump" "$base" | sed -n 's/^error=//p')"
		failed=$((failed + 1))
	else
		echo "PASS base-image"
		passed=$((passed + 1))
	fi
	while IFS=$'\t' read -r name want; do
		got=$("$dump" "$outdir/$name.qcow2" | sed -n 's/^error=//p') || true
		if [ "$got" = "$want" ]; then
			echo "PASS $name"
			passed=$((passed + 1))
		else
			echo "FAIL $name: expected \"$want\", got \"${got:-accepted}\""
			failed=$((failed + 1))
		fi
		# In a subshell, so that a crash is not reported on our stderr
		rc=0
		(qemu-img info -f qcow2 "$outdir/$name.qcow2"; exit $?) \
			>/dev/null 2>&1 ||
			rc=$?
		if [ "$rc" -eq 0 ]; then
			qemu_ok+=("$name")
		elif [ "$rc" -ge 128 ]; then
			qemu_crash+=("$name")
		fi
	done <"$outdir/expected.tsv"
	# Information only: QEMU checks less at open than dm-qcow2 does
	if [ ${#qemu_ok[@]} -gt 0 ]; then
		echo "NOTE qemu-img info opens these, dm-qcow2 refuses them: ${qemu_ok[*]}"
	fi
	if [ ${#qemu_crash[@]} -gt 0 ]; then
		echo "NOTE qemu-img info crashed on: ${qemu_crash[*]}"
	fi
	echo "$passed passed, $failed failed"
	[ "$failed" -eq 0 ]
}

main() {
	local dump=

	if [ "${1:-}" = --verify ]; then
		dump=$(realpath "${2:?usage: $0 --verify QCOW2_DUMP [OUTDIR]}")
		shift 2
	fi
	if [ -n "${1:-}" ]; then
		outdir=$1
		mkdir -p "$outdir"
	elif [ -n "$dump" ]; then
		outdir=$(mktemp -d)
		trap 'rm -rf "$outdir"' EXIT
	else
		echo "usage: $0 OUTDIR | $0 --verify QCOW2_DUMP [OUTDIR]" >&2
		exit 2
	fi
	base="$outdir/base.qcow2.orig"
	make_base "$base"
	generate
	[ -z "$dump" ] || verify "$dump"
}

main "$@"
