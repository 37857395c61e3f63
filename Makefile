# kccl: the two commands a user needs are `make demo` and `make test`.
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo
KCCL := target/release/kccl
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: setup setup-peers build demo test test-unit test-root lint bench-smoke clean

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
test: build lint
	$(CARGO) build --release --workspace --tests
	$(SUDO) env "PATH=$(PATH)" $(CARGO) test --release --workspace -- --test-threads=1
	$(MAKE) bench-smoke

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

bench-smoke: build
	mkdir -p bench-out
	$(SUDO) $(KCCL) bench broadcast --smoke --json bench-out/broadcast-smoke.json --plot bench-out/broadcast-smoke.png
	$(SUDO) $(KCCL) bench reduce --smoke --json bench-out/reduce-smoke.json --plot bench-out/reduce-smoke.png
	$(SUDO) $(KCCL) bench allreduce --smoke --json bench-out/allreduce-smoke.json --plot bench-out/allreduce-smoke.png
	$(SUDO) $(KCCL) bench cpu --smoke --json bench-out/cpu-smoke.json --plot bench-out/cpu-smoke.png

clean:
	$(CARGO) clean
