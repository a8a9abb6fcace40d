# SPDX-License-Identifier: GPL-2.0-only
#
# dm-qcow2: build the module against KDIR (default: the running kernel's
# build tree, else the newest installed Debian headers), run the tests.

KVER ?= $(shell uname -r)
KDIR ?= $(firstword $(wildcard /lib/modules/$(KVER)/build) \
	$(shell ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1))

.PHONY: all modules install clean check unit test style sparse w1 bench bench-quick \
	bench-publish debug-test

all: modules

modules:
	@test -n "$(KDIR)" || { echo "no kernel build tree: set KDIR or run scripts/deps.sh" >&2; exit 1; }
	$(MAKE) -C $(KDIR) M=$(CURDIR) modules

# Without DKMS: install into /lib/modules/<release>/updates (which takes
# precedence over the kernel's own modules) and refresh modules.dep.
# INSTALL_MOD_PATH=<dir> installs under <dir> instead (packaging, tests).
# The release comes from utsrelease.h: Debian's headers carry another
# string in include/config/kernel.release.
KREL = $(shell sed -n 's/^\#define UTS_RELEASE "\(.*\)"/\1/p' \
	$(KDIR)/include/generated/utsrelease.h)

# Distribution headers carry no signing key: then install unsigned (as a
# module built by DKMS without its key) instead of failing in sign-file.
NOSIGN = $(if $(wildcard $(KDIR)/certs/signing_key.pem),,CONFIG_MODULE_SIG_ALL=)

install: modules
	$(MAKE) -C $(KDIR) M=$(CURDIR) INSTALL_MOD_DIR=updates $(NOSIGN) modules_install
	depmod -a $(if $(INSTALL_MOD_PATH),-b $(INSTALL_MOD_PATH)) $(KREL)

# Static checks the kernel community applies
sparse:
	$(MAKE) -C $(KDIR) M=$(CURDIR) C=2 modules

w1:
	$(MAKE) -C $(KDIR) M=$(CURDIR) W=1 modules

clean:
	$(MAKE) -C $(KDIR) M=$(CURDIR) clean
	$(MAKE) -C tests/unit clean

# Host unit tests of the format code (no VM)
unit:
	$(MAKE) -C tests/unit check

# Everything: unit tests, style, VM tests
check test:
	scripts/run-tests

# The VM suite under a KASAN/lockdep/kmemleak kernel (hours under TCG;
# not in CI; Documentation/dev/developer-guide.md, "The debug kernel")
debug-test:
	scripts/debug-kernel run

# Benchmark against loop and qemu-nbd in one guest (not part of the tests)
bench:
	scripts/bench

bench-quick:
	scripts/bench --quick

# The last bench report, as the tool wrote it, becomes the repository's
# (Documentation/benchmarks/report.md and its chart.svg)
bench-publish:
	@for f in report.md chart.svg; do test -f out/bench/$$f || \
		{ echo "no out/bench/$$f: run make bench (chart.svg needs gnuplot)" >&2; exit 1; }; done
	cp out/bench/report.md out/bench/chart.svg Documentation/benchmarks/
