# Tandem: dstack-compatible host and job agents.
# The agents report DSTACK_VERSION, the dstack release they are built as (the
# server compares it for equality with its own; see common/version). Our own
# release is TANDEM_VERSION. `make release VERSION=x.y.z` builds dist/.
TANDEM_VERSION ?= 0.1.0
DSTACK_VERSION ?= 0.21.3
VERSION        ?= $(DSTACK_VERSION)
PKG            := github.com/tandem-run/tandem
LDFLAGS        := -s -w -buildid= -X $(PKG)/common/version.dstack=$(DSTACK_VERSION) -X $(PKG)/common/version.tandem=$(TANDEM_VERSION)
# Go: the first that builds the module (go.mod's go line) of the go on the
# PATH, /usr/local/go's and the one scripts/go.sh fetched into its own dir
# (~/.cache/tandem/go<version>), first on the PATH: a distribution's older
# Go may be there too. None is replaced; GOTOOLCHAIN=local builds with it
# rather than fetching go.mod's toolchain version. Before any Go is here,
# GOPATH is Go's default.
GODIR          := $(shell ./scripts/go.sh --find 2>/dev/null)
export PATH    := $(if $(GODIR),$(GODIR):)$(PATH)
export GOTOOLCHAIN ?= local
GOBIN          := $(or $(shell go env GOPATH 2>/dev/null),$(HOME)/go)/bin
export PATH    := $(PATH):$(GOBIN)
BIN            := $(CURDIR)/bin
GOTEST_FLAGS   ?= -count=1 -timeout 50m
# the VM package's budgets add up to 65 minutes on a slow machine (TCG)
VM_GOTEST_FLAGS ?= -count=1 -timeout 90m
# urfave/cli's man page and markdown writers are never used (see release.sh).
GOTAGS         := urfave_cli_no_docs
# go-nvml's header marks many calls deprecated; we do not use those.
export CGO_CFLAGS ?= -O2 -Wno-deprecated-declarations

.PHONY: all build release test vm-test unit e2e lint deps demo shim fuzz bench bench-table gpu-smoke gpu-kit fresh-check clean

all: build

## build: the three binaries into bin/ (dstack-runner static, CGO_ENABLED=0)
build:
	CGO_ENABLED=0 go build -trimpath -buildvcs=false -tags $(GOTAGS) -ldflags '$(LDFLAGS)' -o $(BIN)/dstack-runner ./cmd/dstack-runner
	go build -trimpath -buildvcs=false -tags $(GOTAGS) -ldflags '$(LDFLAGS)' -o $(BIN)/dstack-shim ./cmd/dstack-shim
	go build -trimpath -buildvcs=false -tags $(GOTAGS) -ldflags '$(LDFLAGS)' -o $(BIN)/tandem ./cmd/tandem

## release: dist/<VERSION>/binaries for linux amd64/arm64 (shim with NVML),
## tandem for linux and darwin, SHA256SUMS and version files (CHECK=1 builds
## twice and compares the sums)
release:
	TANDEM_VERSION=$(TANDEM_VERSION) ./scripts/release.sh $(VERSION) $(CURDIR)/dist

## demo: the main job: one run through both agents on this machine (installs
## only what it needs: Docker, gcc, busybox, and Go into ~/.cache/tandem when
## no Go here builds the module)
demo:
	./scripts/deps.sh demo
	$(MAKE) build
	./scripts/demo.sh

## shim: a shim of your own on this machine, in the foreground, with this
## build's runner (Ctrl-C stops it; its tasks' containers keep running and it
## takes them back at its next start). It binds the API on 127.0.0.1:10998,
## where tandem looks by default, and each host-network job's runner binds
## 10999 (HTTP, localhost) and 10022 (its SSH server, all interfaces, key
## login only) while the job runs. Home: ~/.dstack. As root (sudo when not):
## the API starts containers. SHIM_FLAGS adds flags (dstack-shim --help).
SHIM_FLAGS ?=
shim: build
	$(if $(filter 0,$(shell id -u)),,sudo )$(BIN)/dstack-shim --runner-binary-path $(BIN)/dstack-runner $(SHIM_FLAGS)

## deps: install missing Debian packages and tools, start dockerd if needed
deps:
	./scripts/deps.sh

## lint: gofmt, go vet, staticcheck, shellcheck
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	go vet ./...
	staticcheck ./...
	shellcheck scripts/*.sh .ci/run packer/scripts/*.sh
	./scripts/check-packer.sh

## test: everything CI runs: deps, lint, build, unit and e2e tests on real Docker
test: deps lint build release
	TANDEM_BIN=$(BIN) TANDEM_DIST=$(CURDIR)/dist/$(VERSION) go test $(GOTEST_FLAGS) $$(go list ./... | grep -v '/e2e/vm$$')
	TANDEM_BIN=$(BIN) go test $(VM_GOTEST_FLAGS) -v ./e2e/vm/
	./scripts/leftovers.sh
	FUZZTIME=3s ./scripts/fuzz.sh

## vm-test: the real-VM deployment tests: a Debian 12 guest (QEMU, software
## emulation) gets the shim from tandem cloudinit output and from the Packer
## image; failure paths (no curl, no Docker) fail loudly. ~11 minutes on 2 cores.
vm-test: deps build
	TANDEM_BIN=$(BIN) go test $(VM_GOTEST_FLAGS) -v ./e2e/vm/

## unit: tests without the deps/lint/build steps
unit:
	go test -count=1 -short ./...

## e2e: only the end-to-end tests
e2e: build
	TANDEM_BIN=$(BIN) go test $(GOTEST_FLAGS) -v ./e2e/...

## bench: latency, throughput and memory on a warm local image: task start
## against bare Docker, shim and runner RSS, logs and SSH. Each figure is
## printed against its target (ok or MISSED); the output goes to BENCH_LOG
## and the figures table of docs/figures.md is regenerated from it (bench-table).
## TANDEM_DSTACK_BIN: dstack's shim and runner, built from source, for the
## side-by-side start; TANDEM_BENCH_MACHINE names the machine in the table.
BENCH_LOG ?= bench.log
bench: SHELL := /bin/bash
bench: deps build
	set -o pipefail; { ./scripts/bench-machine.sh && \
	  go test -run '^$$' -bench . -benchmem ./shim/gpu && \
	  TANDEM_BIN=$(BIN) go test -timeout 90m -run '^$$' -bench . -benchtime 20x -count 1 ./e2e/; } 2>&1 | tee $(BENCH_LOG)
	$(MAKE) --no-print-directory bench-table

## bench-table: docs/figures.md's table from BENCH_LOG, dated, with the
## machine named (internal/benchtable)
bench-table:
	go run ./internal/benchtable -log $(BENCH_LOG) -doc docs/figures.md

## gpu-smoke: on a machine with an NVIDIA driver: real NVML tests, then a real
## shim runs a CUDA job through `tandem run --gpus 1`, via the container
## toolkit in CDI mode (DOCKER_BUNDLE: a dir of docker binaries when no
## daemon runs; GPU_KIT: `make gpu-kit`'s file, for a machine without Go
## or Docker; see the script's header)
gpu-smoke: $(if $(GPU_KIT),,build)
	GPU_KIT=$(GPU_KIT) ./scripts/gpu-smoke.sh $(DOCKER_BUNDLE)

## gpu-kit: .gpu-kit/kit.tar.xz, all that gpu-smoke needs on a GPU machine
## with only a driver: Docker 26 from Debian, NVIDIA's container toolkit
## built from its Go module, our binaries and shim/gpu's test binary
gpu-kit: build
	./scripts/gpu-kit.sh $(BIN) $(CURDIR)/.gpu-kit

## fresh-check: the README's set-up promise, proven: make demo on a fresh
## clone in clean Debian 12, Ubuntu 22.04 and 24.04 containers (needs
## network access to their archives and the module proxy)
fresh-check:
	./scripts/fresh-check.sh

## fuzz: every fuzz target for FUZZTIME (60s) each; `make test` runs each for 3s
fuzz:
	FUZZTIME=$${FUZZTIME:-60s} ./scripts/fuzz.sh

clean:
	rm -rf $(BIN) dist
