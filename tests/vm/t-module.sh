# shellcheck shell=bash
# The module: loaded on demand by the first table that names the target,
# and unloaded cleanly when no device uses it.

test_autoload() {
	rm -f img.qcow2
	if lsmod | grep -q '^dm_qcow2 '; then
		fail "dm_qcow2 already loaded before the first table"
		return 1
	fi
	must qemu-img create -f qcow2 img.qcow2 16M || return 1
	dm_create auto "$PWD/img.qcow2" --readonly || return 1
	lsmod | grep -q '^dm_qcow2 ' || fail "module not loaded" || return 1
	dmsetup targets | grep -q '^qcow2 ' || fail "no qcow2 target" || return 1
	dm_remove auto
}

test_unload() {
	must modprobe -r dm-qcow2 || return 1
	! lsmod | grep -q '^dm_qcow2 ' || fail "module still loaded"
}
