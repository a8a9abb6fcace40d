# shellcheck shell=bash
# The VM suite as scripts/run-tests (CI) and scripts/debug-kernel run it,
# in one place. SUITE_SPECS: every case but variants that only repeat a
# case on the other backend (t-corrupt *_loop) or in another geometry
# (two subcluster variants); "scripts/run-tests t-corrupt.sh t-feature.sh"
# runs them all. The last spec unloads the module.
# shellcheck disable=SC2034 # used by the scripts that source this
SUITE_SPECS=(t-module.sh:autoload t-read.sh t-refuse.sh t-write.sh
	't-feature.sh:^test_([^s]|s[^c]|sc_[^c]|sc_c[^12]|sc_co)'
	t-crash.sh t-users.sh t-mutate.sh t-fault.sh
	't-corrupt.sh:^test_[a-z0-9_]*[^p]$'
	t-module.sh:unload)
