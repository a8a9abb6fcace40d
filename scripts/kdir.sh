#!/bin/bash
# Print the kernel build tree matching the guest kernel (scripts/kver.sh),
# so the module is built for the kernel the VM boots.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
kv=$("$here/kver.sh")
for d in "/lib/modules/$kv/build" "/usr/src/linux-headers-$kv"; do
	if [ -d "$d" ]; then
		echo "$d"
		exit 0
	fi
done
echo "kdir.sh: no build tree for $kv" >&2
exit 1
