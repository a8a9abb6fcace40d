# shellcheck shell=bash
# The VM suite as scripts/run-tests (CI) and scripts/debug-kernel run it,
# in one place: every case but variants that only repeat a case on the
# other backend (t-corrupt *_loop) or in another geometry (two subcluster
# variants); "scripts/run-tests t-corrupt.sh t-feature.sh" runs them all.
#
# SUITE_JOBS: the suite in groups of specs, one guest boot each, the
# longest first; scripts/run-tests runs them in lanes side by side (each
# guest keeps about one host core busy), and "boot-test" stands for
# scripts/boot-test. Every guest starts without the module; the job
# holding t-module.sh checks that it loads on demand and unloads.
# t-pressure.sh is not in the suite: it needs a guest of its own (512 MiB,
# two raw disks: "scripts/run-tests t-pressure.sh" gives it one, see
# vm_args there), and swap on dm-qcow2 stalled in 2 of 4 runs on a busy
# host (see the admin guide). SUITE_SPECS: the same specs as one list for
# a single guest (autoload first, unload last), as scripts/debug-kernel
# runs it.
# shellcheck disable=SC2034 # used by the scripts that source this
# Seconds a job took in a fresh-clone run (two lanes, 1-vCPU guests):
# t-write 1049, t-crash 884 (with its host check), t-feature 671, t-read
# and t-refuse 667, t-fault 351, t-mutate 237, t-corrupt 231, t-users 205,
# boot-test 87; t-race (added later) about 330 alone.
SUITE_JOBS=(t-write.sh t-crash.sh
	't-feature.sh:^test_([^s]|s[^c]|sc_[^c]|sc_c[^12]|sc_co)'
	't-module.sh:autoload t-read.sh t-refuse.sh t-module.sh:unload'
	't-users.sh t-race.sh' t-fault.sh t-mutate.sh
	't-corrupt.sh:^test_[a-z0-9_]*[^p]$'
	boot-test)

SUITE_SPECS=(t-module.sh:autoload)
for _job in "${SUITE_JOBS[@]}"; do
	read -ra _specs <<<"$_job"
	for _spec in "${_specs[@]}"; do
		case $_spec in
		boot-test | t-module.sh:*) ;;
		*) SUITE_SPECS+=("$_spec") ;;
		esac
	done
done
SUITE_SPECS+=(t-module.sh:unload)
unset _job _spec _specs
