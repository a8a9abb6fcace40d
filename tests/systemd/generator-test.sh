#!/bin/bash
# Host test of systemd/qcow2-generator: the units it writes for a sample
# /etc/qcow2tab (names, options, block-device and file images, bad lines
# skipped with a message), checked line by line and with
# "systemd-analyze verify". Ends with "N passed, N failed".
set -uo pipefail

top=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
gen=$top/systemd/qcow2-generator
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0

check() {
	local name=$1
	shift
	if "$@"; then
		echo "PASS $name"
		passed=$((passed + 1))
	else
		echo "FAIL $name"
		failed=$((failed + 1))
	fi
}

# has FILE LINE: FILE has LINE, exactly
has() { grep -qxF -- "$2" "$1" || { echo "  $1 lacks: $2" >&2; return 1; }; }

cat >"$work/tab" <<'TAB'
# comment line

vm0	/var/lib/images/vm0.qcow2
vm-1  /srv/images/vm1.qcow2   nofail,cache-size=16m   # trailing comment
gold /var/lib/images/gold.qcow2 ro,snapshot=clean,backing=/srv/base/os.raw
lv /dev/vg0/vm-2 timeout=0
later /var/lib/images/later.qcow2 noauto
bad/name /a.qcow2
rel images/rel.qcow2
opt /a.qcow2 frobnicate
vm0 /var/lib/images/again.qcow2
too /a.qcow2 ro extra
TAB
QCOW2TAB=$work/tab QCOW2_DMSETUP=/bin/true "$gen" "$work/out" \
	2>"$work/messages"
u=$work/out

check units-written test -f "$u/qcow2@vm0.service" -a \
	-f "$u/qcow2@vm\\x2d1.service" -a -f "$u/qcow2@gold.service" -a \
	-f "$u/qcow2@lv.service" -a -f "$u/qcow2@later.service"
check bad-lines-skipped test "$(find "$u" -maxdepth 1 -name '*.service' | wc -l)" -eq 5
check bad-lines-named sh -c "grep -c 'skipped' '$work/messages' | grep -qx 5"
check plain has "$u/qcow2@vm0.service" \
	"ExecStart=/bin/true create vm0 /var/lib/images/vm0.qcow2"
check plain-stop has "$u/qcow2@vm0.service" "ExecStop=/bin/true remove vm0"
check plain-mounts has "$u/qcow2@vm0.service" \
	"RequiresMountsFor=/var/lib/images/vm0.qcow2"
check plain-required test -L "$u/qcow2.target.requires/qcow2@vm0.service"
check device-pulls test -L "$u/dev-mapper-vm0.device.requires/qcow2@vm0.service"
check blockdev-order has "$u/qcow2@vm0.service" \
	"Before=qcow2.target blockdev@dev-mapper-%i.target"
check nofail-wanted test -L "$u/qcow2.target.wants/qcow2@vm\\x2d1.service" -a \
	! -e "$u/qcow2.target.requires/qcow2@vm\\x2d1.service"
check cache-size has "$u/qcow2@vm\\x2d1.service" \
	"ExecStart=/bin/true create vm-1 /srv/images/vm1.qcow2 --cache-size 16m"
check snapshot-backing has "$u/qcow2@gold.service" \
	"ExecStart=/bin/true create gold /var/lib/images/gold.qcow2 --readonly --snapshot clean --backing /srv/base/os.raw"
check backing-mounts has "$u/qcow2@gold.service" \
	"RequiresMountsFor=/var/lib/images/gold.qcow2 /srv/base/os.raw"
check bdev-binds has "$u/qcow2@lv.service" 'BindsTo=dev-vg0-vm\x2d2.device'
check timeout-0 has "$u/qcow2@lv.service" "TimeoutSec=0"
check noauto-unlinked test ! -e "$u/qcow2.target.requires/qcow2@later.service" -a \
	! -e "$u/qcow2.target.wants/qcow2@later.service"
check target-wanted test -L "$u/multi-user.target.wants/qcow2.target"
check no-tab sh -c "QCOW2TAB=$work/none '$gen' '$work/out2' && [ ! -e '$work/out2' ]"
if command -v systemd-analyze >/dev/null; then
	cp "$top/systemd/qcow2.target" "$u/"
	(cd "$u" && systemd-analyze verify --man=no ./*.service ./qcow2.target) \
		>"$work/verify" 2>&1
	check verify sh -c "! grep -v 'is not executable' '$work/verify' | grep ."
	sed 's/^/  /' "$work/verify" | grep -v 'is not executable' >&2
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
