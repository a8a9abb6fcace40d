# shellcheck shell=bash
# Mutated images: a few qemu-img-made seeds, each mutated many times by a
# deterministic seeded mutator (qcow2-poke.py mutate: byte flips and
# overwrites, mostly in the header, L1, L2, refcount table and blocks),
# each result given to dmsetup create read-only, then writable. When
# created, the device is read in full (direct I/O; errors allowed) and,
# writable, written a little, then removed. Each step runs under timeout
# (a hang fails); creation either succeeds or fails with a reason in the
# kernel log; the kernel log shows no splat after any image.
#
# MUTATE_COUNT (or QCOW2_MUTATE_COUNT) mutated images per seed; the CI
# default is 6 (6 seeds, 36 images). The full run, 40 per seed (240):
#   QCOW2_VM_LOCK=/tmp/vm.lock QCOW2_MUTATE_COUNT=40 scripts/vm-run \
#     --disk 16G --timeout 3600 --out out/mut -- tests/vm/run-guest.sh t-mutate.sh
# MUTATE_RUN picks another sequence of mutations (default 1).

MUTATE_COUNT=${MUTATE_COUNT:-${QCOW2_MUTATE_COUNT:-6}}
MUTATE_RUN=${MUTATE_RUN:-${QCOW2_MUTATE_RUN:-1}}
POKE=$QCOW2_TOP/tests/vm/qcow2-poke.py

# mk_seed NAME OPTIONS SIZE [qemu-io commands]
mk_seed() {
	local name=$1 opts=$2 size=$3 c args=()
	shift 3
	must qemu-img create -q -f qcow2 -o "$opts" "$name.qcow2" "$size" ||
		return 1
	for c; do
		args+=(-c "$c")
	done
	[ $# -eq 0 ] || must qemu-io -f qcow2 "${args[@]}" "$name.qcow2"
}

make_seeds() {
	local w=("write -P 0x11 0 8k" "write -P 0x22 3M 64k" "write -z 6M 64k")
	mk_seed v3-4k compat=1.1,cluster_size=4k 8M "${w[@]}" || return 1
	mk_seed v2-512 compat=0.10,cluster_size=512 8M "${w[@]}" || return 1
	mk_seed rb1-64k cluster_size=64k,refcount_bits=1 8M "${w[@]}" ||
		return 1
	mk_seed rb64-lazy cluster_size=4k,refcount_bits=64,lazy_refcounts=on \
		8M "${w[@]}" || return 1
	mk_seed comp cluster_size=4k 8M "write -c -P 0x33 0 4k" \
		"write -P 0x44 1M 4k" || return 1
	mk_seed snap cluster_size=4k 8M "write -P 0x55 0 8k" || return 1
	must qemu-img snapshot -c s1 snap.qcow2 || return 1
	qio_ok snap.qcow2 "write -P 0x66 4k 4k"
}

qio_ok() {
	must qemu-io -f qcow2 -c "$2" "$1"
}

# timed SECONDS CMD...: run CMD, fail the case if it does not finish.
timed() {
	timeout "$@"
	local rc=$?
	[ $rc -ne 124 ] || fail "hung (killed after $1 s): ${*:2}"
	return $rc
}

# One image, one mode (ro or rw). Returns 1 on a hang or an unexplained
# refusal; sets CREATED when the device was made.
try_image() {
	local img=$1 sectors=$2 mode=$3 mark rc ro=
	CREATED=
	[ "$mode" = rw ] || ro=--readonly
	mark="t-mutate: $img $mode $$-$RANDOM"
	echo "$mark" >/dev/kmsg
	timed 60 dmsetup create mut $ro \
		--table "0 $sectors qcow2 $img" 2>/dev/null
	rc=$?
	[ $rc -ne 124 ] || return 1
	if [ $rc -ne 0 ]; then
		dmesg | sed -n "\\|$mark|,\$p" | grep -q 'qcow2: ' ||
			fail "$img ($mode) refused with no reason logged" ||
			return 1
	else
		CREATED=1
		dmsetup mknodes mut
		timed 300 dd if=/dev/mapper/mut of=/dev/null bs=64k \
			iflag=direct status=none 2>/dev/null
		[ $? -ne 124 ] || return 1
		if [ "$mode" = rw ]; then
			timed 60 dd if=/dev/urandom of=/dev/mapper/mut bs=4k \
				count=4 seek=$((sectors / 8 / 3)) oflag=direct \
				conv=notrunc status=none 2>/dev/null
			[ $? -ne 124 ] || return 1
			timed 60 dd if=/dev/urandom of=/dev/mapper/mut bs=512 \
				count=3 seek=1 oflag=direct,sync conv=notrunc \
				status=none 2>/dev/null
			[ $? -ne 124 ] || return 1
		fi
		timed 60 dmsetup remove mut || return 1
	fi
	"$QCOW2_TOP/scripts/dmesg-check" --since "$mark" ||
		fail "kernel splat with $img ($mode)"
}

test_mutated_images() {
	local seed name sectors what n=0 made=0 bad=0
	rm -rf mut && mkdir mut && cd mut || return 1
	make_seeds || return 1
	for seed in *.qcow2; do
		while read -r name sectors what; do
			n=$((n + 1))
			for mode in ro rw; do
				if ! try_image "$PWD/$name" "$sectors" $mode; then
					echo "  repro: qcow2-poke.py mutate $seed m $MUTATE_RUN $MUTATE_COUNT -> $name: $what" >&2
					bad=$((bad + 1))
					# A hung or splatted kernel: stop here
					return 1
				fi
				[ -z "$CREATED" ] || made=$((made + 1))
			done
			rm -f "$name"
		done < <(python3 "$POKE" mutate "$seed" "m-${seed%.qcow2}" \
			"$MUTATE_RUN" "$MUTATE_COUNT")
		log "$seed: $n images so far, $made activations"
	done
	log "$n mutated images, $made of $((2 * n)) activations succeeded"
	[ "$n" -eq $((6 * MUTATE_COUNT)) ] || fail "only $n images" || return 1
	[ "$bad" -eq 0 ]
}
