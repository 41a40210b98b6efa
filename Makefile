# gpufault task runner. `make help` lists the targets.
.DELETE_ON_ERROR:
.PHONY: help setup deps build wheel man test test-unit test-host vmtest vm-kernels kmod kmod-deps kmod-check demo demo-experiment bench lint clean device-bundle

PYTHON ?= python3
CLANG ?= clang
BPFTOOL ?= bpftool
OUT := build
DATA := pyctl/data
ifeq ($(V),1)
Q :=
else
Q := @
endif
# -mcpu=v3: clang 14 aborts on atomics whose result is used without it.
BPF_CFLAGS := -g -O2 -target bpf -mcpu=v3 -D__TARGET_ARCH_x86 -Wall -Werror -I bpf -idirafter /usr/include/$(shell $(CC) -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)

BPF_SRCS := $(wildcard bpf/*.bpf.c)
BPF_OBJS := $(patsubst bpf/%.bpf.c,$(DATA)/%.bpf.o,$(BPF_SRCS))
# Built binaries the wheel carries live in the package (git-ignored), one
# place for a checkout and an install: pyctl/paths.py names them.
DOUBLES := $(DATA)/doubles/gf-infer
PRELOAD := $(DATA)/preload/gfpreload.so
LIBS := $(DATA)/lib/libbpf.so.1
GFSIG := $(DATA)/helper/gfsig.so

help:
	@echo "make setup        install apt + pip dependencies, then build"
	@echo "make build        compile bpf/*.bpf.c to CO-RE objects in $(DATA)/, the test doubles,"
	@echo "                  the LD_PRELOAD shim, and copy libbpf/libelf, all into $(DATA)/"
	@echo "make wheel        build + the platform wheel (everything inside) into dist/"
	@echo "make man          gpufault(1) from the commands into $(OUT)/man/ (man -l to read)"
	@echo "make demo         inject faults into the libcuda CPU double's workload, show evidence"
	@echo "make demo-experiment  one chaos experiment end to end (root, < 1 min): verdict + evidence"
	@echo "make test         unit + host (root, real BPF) + vm (qemu/TCG) tests"
	@echo "make bench        benchmarks, results to docs/benchmarks.md"
	@echo "make vm-kernels   fetch Debian bookworm 6.1 / sid 7.2 test kernels into $(OUT)/vm/"
	@echo "make kmod         build gpufa.ko against the VM's 6.1 headers"
	@echo "make lint         ruff + mypy + the layering contract (lint-imports)"
	@echo "make device-bundle  prepare .device/ for the GPU machine"

setup: deps build

deps:
	bash tools/setup-deps.sh

TARGETS := $(OUT)/targets/gf_target $(OUT)/targets/libgftarget.so $(OUT)/targets/gf_cxx \
	$(OUT)/targets/gf_mainexit $(OUT)/targets/gf_errno $(OUT)/targets/gf_nofp \
	$(OUT)/targets/gf_nofp_cc $(OUT)/targets/gf_sites

build: $(BPF_OBJS) $(DOUBLES) $(TARGETS) $(PRELOAD) $(LIBS) $(GFSIG)

# The shim goes into the package; its own libcuda test double stays in build/.
$(PRELOAD): $(wildcard pyctl/hooks/preload/*.c doubles/preload/*.c pyctl/hooks/preload/Makefile)
	$(Q)$(MAKE) -s -C pyctl/hooks/preload OUT=$(abspath $(DATA)/preload) \
		DOUBLE_OUT=$(abspath $(OUT)/hooks/double)

$(LIBS): tools/bundle-libs.sh
	$(Q)bash tools/bundle-libs.sh $(DATA)/lib

# py3-none-linux_x86_64 (setup.py): one wheel for Python 3.10+.
wheel: build
	$(PYTHON) -m build --wheel --outdir dist

# gpufault(1), generated from the click commands (pyctl/cli/man.py).
man:
	$(Q)$(PYTHON) -m pyctl.cli.man -o $(OUT)/man/gpufault.1

# Test targets: probed by the host tests; frame pointers, no CET, so each
# function starts with `push %rbp` (a probe the kernel emulates); -O0 for
# the library because gcc drops the prologue of leaf functions at -O2.
TARGET_CFLAGS := -O2 -g -fno-omit-frame-pointer -mno-omit-leaf-frame-pointer -fcf-protection=none -Wall -Werror
$(OUT)/targets/libgftarget.so: tests/targets/libgftarget.c
	@mkdir -p $(dir $@)
	$(Q)$(CC) $(TARGET_CFLAGS) -O0 -shared -fPIC -o $@ $<

# C++ names for the symbolizer's tests (a namespace and a class template).
$(OUT)/targets/gf_cxx: tests/targets/gf_cxx.cc
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(TARGET_CFLAGS) -o $@ $<

$(OUT)/targets/gf_target: tests/targets/gf_target.c $(OUT)/targets/libgftarget.so
	$(Q)$(CC) $(TARGET_CFLAGS) -o $@ $< -L$(OUT)/targets -lgftarget -Wl,-rpath,'$$ORIGIN' -lpthread

# Built without frame pointers, as distributions build -O2 code: only the
# call-frame information unwinds them (tests/test_unwind.py, peer: perf).
NOFP_CFLAGS := -O2 -fomit-frame-pointer -fcf-protection=none -Wall -Werror
$(OUT)/targets/gf_nofp: tests/targets/gf_nofp.c
	@mkdir -p $(dir $@)
	$(Q)$(CC) $(NOFP_CFLAGS) -o $@ $< -lpthread

$(OUT)/targets/gf_nofp_cc: tests/targets/gf_nofp_cc.cc
	@mkdir -p $(dir $@)
	$(Q)$(CXX) $(NOFP_CFLAGS) -o $@ $< -lpthread

# An HTTP server with two call sites of gf_alloc: one tolerated, one fatal
# to its requests (`gpufault explore`, tests/test_explore*.py).
$(OUT)/targets/gf_sites: tests/targets/gf_sites.c $(OUT)/targets/libgftarget.so
	$(Q)$(CC) $(TARGET_CFLAGS) -o $@ $< -L$(OUT)/targets -lgftarget -Wl,-rpath,'$$ORIGIN' -lpthread

# A process whose main thread has exited while its workers call the library.
$(OUT)/targets/gf_mainexit: tests/targets/gf_mainexit.c $(OUT)/targets/libgftarget.so
	$(Q)$(CC) $(TARGET_CFLAGS) -o $@ $< -L$(OUT)/targets -lgftarget -Wl,-rpath,'$$ORIGIN' -lpthread

# libc calls that a fail with --errno makes fail (strerror(errno) printed).
$(OUT)/targets/gf_errno: tests/targets/gf_errno.c
	@mkdir -p $(dir $@)
	$(Q)$(CC) $(TARGET_CFLAGS) -o $@ $< -lpthread

$(DATA)/%.bpf.o: bpf/%.bpf.c bpf/*.h
	@mkdir -p $(DATA)
	@echo "  BPF     $@"
	$(Q)$(CLANG) $(BPF_CFLAGS) -c $< -o $@.tmp
	$(Q)$(BPFTOOL) gen object $@ $@.tmp 2>/dev/null || cp $@.tmp $@
	$(Q)rm -f $@.tmp

$(DOUBLES): $(wildcard doubles/*.c doubles/*.h doubles/Makefile)
	$(Q)$(MAKE) -s -C doubles OUT=$(abspath $(DATA)/doubles)

# TEST_JOBS=3: the suite on three pytest-xdist workers, grouped so that
# what must not run side by side does not (tests/conftest.py,
# docs/tests.md): 12 min on this 2-core machine instead of 46 serially,
# every test kept. Plain `make test` (and so CI) stays serial until a
# series of parallel runs is clean: three on 2026-12-03 failed 1, 0 and 2
# tests, each fixed since (docs/tests.md).
# PYTHONDONTWRITEBYTECODE off: pytest then caches what it rewrote (every
# pyctl module, through the pytest11 plugin) and the CLI children their
# bytecode, instead of each process redoing it (minutes over a run).
TEST_JOBS ?=
PYTEST_JOBS = $(if $(TEST_JOBS),-n $(TEST_JOBS) --dist loadgroup --no-loadscope-reorder)
test: build vm-kernels kmod-deps
	env -u PYTHONDONTWRITEBYTECODE $(PYTHON) -m pytest -q -ra $(PYTEST_JOBS) tests

test-unit:
	$(PYTHON) -m pytest -q -ra -m "not root and not vm" tests

test-host: build
	$(PYTHON) -m pytest -q -ra -m "root" tests

vmtest: build vm-kernels
	$(PYTHON) -m pytest -q -ra -m "vm" tests

vm-kernels:
	$(PYTHON) vm/fetch_kernels.py

# gpufa.ko against bookworm's 6.1 headers (what the VM tests boot).
kmod: vm-kernels
	$(MAKE) -C kmod KDIR=$$(cat $(OUT)/vm/bookworm/kdir) tests

# checkpatch.pl and the extra headers (6.12, 7.2) the build tests use.
kmod-deps: vm-kernels
	$(PYTHON) kmod/fetch_deps.py

kmod-check:
	$(MAKE) -C kmod check

demo: build
	$(PYTHON) -m pyctl demo --db $(OUT)/demo.db

# A chaos experiment (docs/experiments.md): sticky OOM from the libcuda test
# double against the reference service; prints the verdict line (exit 0 =
# pass) and the evidence (`experiment results`). GF_EXPERIMENT picks another.
GF_EXPERIMENT ?= cuda-oom-degrade
GF_EXP_CLI := $(PYTHON) -m pyctl experiment
demo-experiment: build
	$(Q)rm -f $(OUT)/demo-experiment.db $(OUT)/demo-experiment.db-wal $(OUT)/demo-experiment.db-shm
	$(Q)$(GF_EXP_CLI) run $(GF_EXPERIMENT) --db $(OUT)/demo-experiment.db; rc=$$?; \
	  $(GF_EXP_CLI) results --db $(OUT)/demo-experiment.db | head -1 | cut -d' ' -f1 | \
	  xargs -r -I{} $(GF_EXP_CLI) results {} --db $(OUT)/demo-experiment.db; exit $$rc

bench: build
	$(PYTHON) bench/run_all.py

lint:
	$(PYTHON) -m ruff check pyctl tests bench vm doubles kmod
	$(PYTHON) -m mypy pyctl
	lint-imports  # the layering contract in pyproject.toml (docs/layers.md)

device-bundle: build
	PYTHON=$(PYTHON) bash tools/device-bundle.sh

clean:
	rm -rf $(OUT) $(DATA)/*.bpf.o $(DATA)/doubles $(DATA)/preload $(DATA)/lib dist

# The signal fast path's in-target helper (pyctl/fastpath/gfsig.c, issue 26):
# libc only, loaded into targets by a ptrace-driven dlopen.
$(GFSIG): pyctl/fastpath/gfsig.c pyctl/fastpath/gfsig.h
	@mkdir -p $(dir $@)
	$(Q)$(CC) -O2 -g -Wall -Werror -fPIC -shared -fvisibility=hidden -o $@ $<
