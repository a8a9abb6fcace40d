# shellcheck shell=bash
# Memory leaks, under a kernel with kmemleak (scripts/debug-kernel): "clear"
# first (what boot left behind is not ours), the other cases, then "scan"
# while dm-qcow2 is still loaded (its symbols name the allocation sites).
# "scan" fails on unreferenced objects allocated through dm_qcow2; the
# full report goes to $VM_OUT/kmemleak.txt. Without kmemleak both pass.

KMEMLEAK=/sys/kernel/debug/kmemleak

test_clear() {
	if [ ! -e "$KMEMLEAK" ]; then
		log "no kmemleak in this kernel"
		return 0
	fi
	echo clear >"$KMEMLEAK" || fail "kmemleak is disabled"
}

test_scan() {
	local report=${VM_OUT:-/tmp}/kmemleak.txt ours
	if [ ! -e "$KMEMLEAK" ]; then
		log "no kmemleak in this kernel"
		return 0
	fi
	# An object is only reported once it is older than 5 s, and a scan
	# can miss a pointer in flight: two scans, as the documentation says.
	sleep 6
	echo scan >"$KMEMLEAK" || fail "kmemleak is disabled" || return 1
	sleep 6
	echo scan >"$KMEMLEAK" || fail "kmemleak is disabled" || return 1
	cat "$KMEMLEAK" >"$report"
	log "$(grep -c '^unreferenced object' "$report") unreferenced object(s) in all ($report)"
	ours=$(awk '/^unreferenced object/ { if (rec ~ /dm_qcow2/) printf "%s", rec; rec = "" }
		{ rec = rec $0 "\n" }
		END { if (rec ~ /dm_qcow2/) printf "%s", rec }' "$report")
	[ -n "$ours" ] || return 0
	echo "$ours" >&2
	fail "$(echo "$ours" | grep -c '^unreferenced object') leak(s) through dm_qcow2"
}
