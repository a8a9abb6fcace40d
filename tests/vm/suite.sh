# shellcheck shell=bash
# The VM suite as scripts/run-tests (CI) and scripts/debug-kernel run it,
# in one place: every case but variants that only repeat a case on the
# other backend (t-corrupt *_loop) or in another geometry (two subcluster
# variants); "scripts/run-tests t-corrupt.sh t-feature.sh" runs them all.
#
# SUITE_JOBS: the suite in groups of specs, one guest boot each, the
# longest first; scripts/run-tests runs them in lanes side by side (each
# guest keeps about one host core busy), and "distro-test" stands for
# scripts/distro-test (Debian 12 guests with systemd and the packages,
# qcow2tab devices and the root in a qcow2 image). Every guest starts
# without the module; the job holding t-module.sh checks that it loads on
# demand and unloads.
# t-pressure.sh needs a guest of its own (512 MiB, two raw disks:
# scripts/run-tests gives it one, see vm_args there). "demo" stands for
# the README's main job (scripts/demo, with the module already built), and
# "kernel=6.12 SPEC..." runs the specs under Debian 12's second kernel with
# the module built for it (scripts/build-for): SUITE_CORE, a core set
# (read, write, a crash sample, one case of each feature kind).
# SUITE_SPECS: the specs of SUITE_JOBS but those needing a guest of their
# own, as one list for a single guest (autoload first, unload last), as
# scripts/debug-kernel runs it.
# shellcheck disable=SC2034 # used by the scripts that source this
# Seconds a job took in a fresh-clone CI run (two lanes, 1-vCPU guests):
# distro-test about 1200 on a fresh machine (its Debian root made first;
# 720 once cached), t-write 785, t-crash 713 (with its host check), the NFS job 491,
# users/race/lock 457, t-read and t-refuse 448, the 6.12 core set 380,
# t-feature 363, t-pressure 205, t-fault 200, t-corrupt 146,
# t-mutate 124.
SUITE_CORE=(t-module.sh:autoload
	't-read.sh:^test_(v2_c4k|v3_c64k|v3_c2m|status_and_table|zero_alloc)$'
	't-write.sh:^test_(m03_c4k_v3_rb1_file|m05_c64k_v3_rb64_loop|fs_ext4|gather_c64k_file|resume_refused|status)$'
	't-crash.sh:^test_l2_alloc$'
	't-feature.sh:^test_(chain_three_deep|discard_plain|wz_v3|grow|sc_c64k|zip_write_zstd_c4k|zip_deflate_c64k|snapshot_activate)$'
	't-race.sh:^test_(cache_waiter_dirty|held_write_bdev)$' 't-fault.sh:^test_(write_fault_file|meta_fault_bdev)$'
	't-lock.sh:^test_(writer_locks_out_qemu|qemu_writer_refuses_table)$'
	t-module.sh:unload)
# SUITE_NFS: images on NFS (tests/vm/nfs-lib.sh): t-nfs.sh's own cases,
# and cases of the write, crash and lock tests with their images there.
SUITE_NFS=(t-nfs.sh
	'nfs:t-write.sh:^test_(m03_c4k_v3_rb1_file|m05_c64k_v3_rb64_loop|m06_c64k_v2_file|fs_ext4|gather_c64k_file|conc_overlap|span_mixed_file|status)$'
	'nfs:t-crash.sh:^test_(l2_alloc|gathered)$' nfs:t-lock.sh)
SUITE_JOBS=(distro-test t-write.sh t-crash.sh
	't-module.sh:autoload t-read.sh t-refuse.sh t-module.sh:unload'
	"kernel=6.12 ${SUITE_CORE[*]}" 't-users.sh t-race.sh t-lock.sh'
	"${SUITE_NFS[*]}"
	't-feature.sh:^test_([^s]|s[^c]|sc_[^c]|sc_c[^12]|sc_co)'
	t-pressure.sh t-fault.sh t-mutate.sh
	't-corrupt.sh:^test_[a-z0-9_]*[^p]$'
	demo)

SUITE_SPECS=(t-module.sh:autoload)
for _job in "${SUITE_JOBS[@]}"; do
	read -ra _specs <<<"$_job"
	[[ ${_specs[0]} != kernel=* ]] || continue
	for _spec in "${_specs[@]}"; do
		case $_spec in
		distro-test | demo | t-module.sh:* | t-pressure.sh*) ;;
		*) SUITE_SPECS+=("$_spec") ;;
		esac
	done
done
SUITE_SPECS+=(t-module.sh:unload)
unset _job _spec _specs
