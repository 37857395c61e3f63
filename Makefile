# kccl: the two commands a user needs are `make demo` and `make test`.
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo
KCCL := target/release/kccl
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: setup setup-peers build demo test test-unit test-root lint bench bench-smoke clean \
	test-kernels test-kernels-smoke host-health test-mtus

setup:
	@bash scripts/setup.sh

# Gloo (python3-torch) and Open MPI (openmpi-bin, python3-mpi4py) for `kccl bench peers`.
setup-peers:
	@bash scripts/setup-peers.sh

build: setup
	$(CARGO) build --release --workspace

# Builds, makes a 10-host virtual cluster, broadcasts and allreduces through both paths, compares, tears down.
demo: build
	$(SUDO) $(KCCL) demo

# Every test tier: unit, BPF_PROG_TEST_RUN fixtures, namespace topologies, CLI errors, bench smoke.
# Order matters: no native kernel test runs on a kernel that already reported memory
# corruption (host-health), nor before the same programs ran clean in a VM of this
# machine's kernel series (test-kernels-smoke, docs/KERNELS.md).
test: build setup-peers lint host-health test-kernels-smoke
	$(CARGO) build --release --workspace --tests
	$(SUDO) env "PATH=$(PATH)" $(CARGO) test --release --workspace -- --test-threads=1
	$(MAKE) test-mtus
	$(MAKE) bench-smoke

# The suite runs at the cluster's default MTU (9000); reduce and allreduce must also be exact,
# under loss on one link and on every link, with the chunks of MTU 1500 and 65000 (a few seconds).
test-mtus:
	for mtu in 1500 65000; do \
	  $(SUDO) env "PATH=$(PATH)" KCCL_CLUSTER_MTU=$$mtu $(CARGO) test --release -p kccl-testbed \
	    --test topology_agg_faults -- --test-threads=1 exact_under_faults_kernel || exit 1; \
	done

# Refuses native kernel tests when this machine's kernel log shows memory corruption.
host-health:
	@bash tests/kernels/host-health.sh

# The fixtures and a small broadcast, reduce and allreduce in a VM of this machine's kernel
# series (a few minutes): part of `make test`, before any native kernel test.
test-kernels-smoke: build
	$(SUDO) env "PATH=$(PATH)" bash tests/kernels/matrix.sh --smoke

# The kernel matrix: Debian's newest 6.12, this machine's series and 7.x in VMs, fixtures and
# kernel-path topologies with loss; fails on any kernel complaint. Hours (emulated CPU).
test-kernels: build
	$(SUDO) env "PATH=$(PATH)" bash tests/kernels/matrix.sh

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	# The user-space-only build (no BPF toolchain) must keep compiling.
	$(CARGO) clippy --release -p kccl --no-default-features -- -D warnings

# The whole benchmark suite (docs/BENCHMARKS.md): kernel path, user-space path, Gloo and
# Open MPI; one JSON + PNG per experiment and summary.md in BENCH_OUT. Takes hours at full size;
# BENCH_ARGS narrows it, e.g. BENCH_ARGS="--experiments bcast-receivers,bcast-size --max-bytes 134217728".
BENCH_OUT ?= bench-out/suite
BENCH_ARGS ?=
bench: build setup-peers
	$(SUDO) $(KCCL) bench all --out $(BENCH_OUT) $(BENCH_ARGS)

# The suite's smoke mode (every experiment, small points, peers included): part of `make test`,
# ~1.5 min here, fails if any result check fails.
bench-smoke: build setup-peers
	$(SUDO) $(KCCL) bench all --smoke --out bench-out/suite-smoke
	$(SUDO) $(KCCL) bench loss --smoke --json bench-out/loss-smoke.json --plot bench-out/loss-smoke.png

clean:
	$(CARGO) clean
