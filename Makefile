# tailwarden: the two commands a new user needs are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
CACHE := $(CURDIR)/.cache

.PHONY: all build test unit deps release-bins e2e images e2e-images operator-scale sdk sdk-deps pyupstream-deps system-deps tools lint fmt fmt-check crds clippy controlplane-smoke observability-test battery

all: build

build:
	$(CARGO) build --workspace --bins

## test: everything CI runs — formatting, lints, unit and integration tests (the Helm chart
## rendered by the real helm), the real OpenAI SDKs.
test: fmt-check clippy unit sdk observability-test fuzz-smoke

unit: deps e2e-images
	@# Jaeger v2 (tests/traces_jaeger.rs) builds in the background at the lowest CPU priority,
	@# on what cargo leaves idle; the test waits on the build's lock. A failed background
	@# build is redone, with its errors, by the test. Log: .cache/jaeger-build.log.
	@# The battery's never-worse subset judges the release sidecar (release-bins, part of deps):
	@# a debug build's own overhead is not what users run.
	mkdir -p $(CACHE) && (nice -n 19 e2e/jaeger/build.sh > $(CACHE)/jaeger-build.log 2>&1 &)
	TAILWARDEN_CONTROLPLANE_BIN=$$(e2e/controlplane/build.sh | tail -n 1) \
	  TAILWARDEN_HELM=$$(e2e/controlplane/build.sh | tail -n 1)/helm \
	  TAILWARDEN_BATTERY_SIDECAR=$(TARGET_DIR)/release/tailwarden-sidecar \
	  $(CARGO) test --workspace --no-fail-fast

## e2e: the user journey on a real node — containerd, runc, the CNI bridge, kube-proxy and a
## kubelet beside the local control plane, in namespaces of its own — with the images built
## here (helm install → route → injected pod: the OpenAI SDK through the sidecar → ConfigMap
## and Secret updates → pod deletion → helm uninstall). Builds everything it needs; needs
## root. Also part of `make test`.
e2e: tools system-deps e2e-images
	TAILWARDEN_CONTROLPLANE_BIN=$$(e2e/controlplane/build.sh | tail -n 1) \
	  $(CARGO) test -p tailwarden-e2e --test journey -- --nocapture

## images: the operator and sidecar container images — release binaries on a minimal root of
## Debian packages, FROM scratch, uid 65532, no shell — built by buildah (no Docker daemon, no
## registry) into OCI archives with their digests under .cache/images/ (images.txt lists
## them). IMAGE_REGISTRY=... names them for your registry (docs/operator.md). Needs root.
IMAGE_REGISTRY ?= ghcr.io
images: system-deps
	IMAGE_REGISTRY=$(IMAGE_REGISTRY) bash images/build.sh operator sidecar

## e2e-images: the product images plus the e2e node's pause image and the journey's app.
# Always the chart's default names: the journey installs the chart with its defaults.
e2e-images: tools system-deps
	IMAGE_REGISTRY=ghcr.io bash images/build.sh operator sidecar pause openai-app

## operator-scale: 500 routes on a real control plane; prints create→ConfigMap latency and RSS.
operator-scale: tools
	TAILWARDEN_CONTROLPLANE_BIN=$$(e2e/controlplane/build.sh | tail -n 1) \
	  $(CARGO) test --release -p tailwarden-operator --test scale -- --ignored --nocapture

## deps: what the tests need, prepared side by side (make -j): the Go build of the control
## plane and node, the release build of the images' two binaries — both CPU-bound, but each
## ends in long single-threaded link steps that the other fills — and the package installs
## (network-bound). Output is grouped per target.
deps:
	$(MAKE) --no-print-directory -j4 -Otarget tools sdk-deps pyupstream-deps system-deps release-bins

release-bins:
	$(CARGO) build --release --locked -p tailwarden-operator -p tailwarden-sidecar

## system-deps: Debian packages the tests start or use, installed when missing (one
## apt-get for all): redis-server for the shared rate limits; containerd, runc, the CNI
## plugins, iptables and conntrack for the e2e node; buildah and binutils for the images.
SYSTEM_DEPS := redis-server:redis-server containerd:containerd runc:runc \
  /usr/lib/cni/bridge:containernetworking-plugins iptables:iptables conntrack:conntrack \
  buildah:buildah readelf:binutils setpriv:util-linux
system-deps:
	@missing=""; for dep in $(SYSTEM_DEPS); do cmd=$${dep%%:*}; pkg=$${dep#*:}; \
	  if [[ $$cmd == /* ]]; then [[ -e $$cmd ]] || missing+=" $$pkg"; \
	  else command -v $$cmd >/dev/null 2>&1 || missing+=" $$pkg"; fi; done; \
	  bash e2e/debian-install.sh $$missing

## tools: helm and the local Kubernetes control plane, built once from the Go module proxy.
tools:
	e2e/controlplane/build.sh

## jaeger: Jaeger v2, the real tracing backend of the span tests (`make test` builds it in the
## background), once from the Go module proxy into .cache/jaeger/.
.PHONY: jaeger
jaeger:
	e2e/jaeger/build.sh

## sdk: the real OpenAI Python and Node SDKs against the sidecar and the simulator.
sdk: sdk-deps
	$(CARGO) build --bins -p tailwarden-sidecar -p tailwarden-e2e
	e2e/sdk/run.sh $(CURDIR)/target/debug

sdk-deps: $(CACHE)/venv/.installed e2e/sdk/node_modules/.installed

## pyupstream-deps: aiohttp (pinned) for the battery's Python upstream, e2e/pyupstream/sim.py.
pyupstream-deps: $(CACHE)/pyupstream/.installed

$(CACHE)/pyupstream/.installed: e2e/pyupstream/requirements.txt
	python3 -m venv $(CACHE)/pyupstream
	$(CACHE)/pyupstream/bin/pip install --quiet --disable-pip-version-check -r e2e/pyupstream/requirements.txt
	$(CACHE)/pyupstream/bin/python e2e/pyupstream/sim.py --self-test
	touch $@

$(CACHE)/venv/.installed: e2e/sdk/requirements.txt
	python3 -m venv $(CACHE)/venv
	$(CACHE)/venv/bin/pip install --quiet --disable-pip-version-check -r e2e/sdk/requirements.txt
	touch $@

e2e/sdk/node_modules/.installed: e2e/sdk/package.json e2e/sdk/package-lock.json
	cd e2e/sdk && npm ci --no-audit --no-fund --loglevel=error
	touch $@

## lint: formatting and clippy, warnings are errors.
lint: fmt-check clippy

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

fmt-check:
	$(CARGO) fmt --all -- --check

## crds: regenerate the CRD and the field reference from the Rust types (a test fails on drift).
# Written through temporary files, so a failed generator never leaves an empty CRD behind.
crds:
	$(CARGO) run -q -p tailwarden-operator -- crd > crds/.inferenceroute.yaml.tmp
	$(CARGO) run -q -p tailwarden-operator -- reference > docs/.inferenceroute-reference.md.tmp
	mv crds/.inferenceroute.yaml.tmp crds/inferenceroute.yaml
	mv docs/.inferenceroute-reference.md.tmp docs/inferenceroute-reference.md
	cp crds/inferenceroute.yaml charts/tailwarden/crds/inferenceroute.yaml

# Release binaries land here (honours CARGO_TARGET_DIR like cargo does).
TARGET_DIR ?= $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)

## demo: the seeds' before/after table, measured live on simulated providers — a flaky
## primary and a backup — straight vs through tailwarden-sidecar. No cluster, nothing to
## install beyond the build; about two minutes after it. Extra flags: make demo DEMO_ARGS='--rate 80'.
demo:
	$(CARGO) build --release -p tailwarden-sidecar -p tailwarden-e2e
	$(TARGET_DIR)/release/tailwarden-demo $(DEMO_ARGS)

## bench: tailwarden-sidecar's overhead next to nginx, LiteLLM and Portkey (installed pinned
## into .cache/ by bench-peers), the flaky/brownout tail cut, and the battery (direct /
## sidecar / oracle limit on every profile × topology, hyper and aiohttp upstreams, the
## never-worse verdict per cell); writes docs/benchmarks.md. About 45 minutes on 2 cores after
## the build (the battery is 30 of them). Not part of `make test`.
bench: bench-peers pyupstream-deps
	$(CARGO) build --release -p tailwarden-sidecar -p tailwarden-e2e
	$(TARGET_DIR)/release/tailwarden-benchmark --cache $(CACHE) $(BENCH_ARGS)

## battery: only the battery, printed (no docs written). Cells, rate and length through
## BATTERY_ARGS, e.g. make battery BATTERY_ARGS='--cells independent/one/hyper --duration 20s'.
battery: pyupstream-deps
	$(CARGO) build --release -p tailwarden-sidecar -p tailwarden-e2e
	$(TARGET_DIR)/release/tailwarden-battery --python $(CACHE)/pyupstream/bin/python $(BATTERY_ARGS)

## bench-peers: install the peer gateways for `make bench` (pinned, cached, idempotent).
bench-peers:
	bash e2e/bench/install-peers.sh $(CACHE)

## controlplane-smoke: a real kube-apiserver/etcd/KCM/scheduler/kwok on loopback (built once
## from the Go module proxy into .cache/controlplane) accepts our CRD and examples, rejects bad routes.
controlplane-smoke:
	e2e/controlplane/smoke.sh

## observability-test: Debian's prometheus (installed when missing; its service is not
## started): promtool checks and unit-tests the chart's alert rules, and a real Prometheus
## scrapes the real sidecar under simulated load: every metric, dashboard panel and rule.
observability-test:
	bash e2e/prometheus/install.sh
	$(CARGO) test -p tailwarden-e2e --test prometheus -- --ignored --test-threads 1

## fuzz-smoke / fuzz: the cargo-fuzz targets in fuzz/ (docs/fuzzing.md), one after the other,
## one libFuzzer process at a time. fuzz-smoke (part of `make test`) runs each for
## FUZZ_SMOKE_SECONDS, `make fuzz` for FUZZ_SECONDS; a crash fails the run and leaves its
## input in fuzz/artifacts/TARGET/. Needs the nightly toolchain; cargo-fuzz is installed
## pinned into .cache/ by fuzz-deps. Extra libFuzzer flags: make fuzz FUZZ_ARGS='-max_len=8192'.
.PHONY: fuzz fuzz-smoke fuzz-deps
CARGO_FUZZ_VERSION := 0.13.2
FUZZ_SECONDS ?= 300
FUZZ_SMOKE_SECONDS ?= 20
FUZZ_TARGETS ?= request_parser sse_scanner config_loader units

fuzz-smoke: fuzz-deps
	PATH=$(CACHE)/cargo-fuzz/bin:$$PATH bash fuzz/run.sh $(FUZZ_SMOKE_SECONDS) $(FUZZ_TARGETS)

fuzz: fuzz-deps
	PATH=$(CACHE)/cargo-fuzz/bin:$$PATH bash fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_TARGETS)

fuzz-deps: $(CACHE)/cargo-fuzz/.installed-$(CARGO_FUZZ_VERSION)

$(CACHE)/cargo-fuzz/.installed-$(CARGO_FUZZ_VERSION):
	$(CARGO) install --locked --root $(CACHE)/cargo-fuzz cargo-fuzz --version $(CARGO_FUZZ_VERSION)
	touch $@

## soak: SOAK_MINUTES (default 30) of steady open-loop load through the release sidecar in
## front of two `flaky` simulated providers; samples the sidecar's RSS and open fds and reports
## the growth (target: RSS under 5 %, fds flat). Not part of `make test`. Report in .cache/soak/.
SOAK_MINUTES ?= 30
.PHONY: soak
soak:
	$(CARGO) build --release -p tailwarden-sidecar -p tailwarden-e2e
	mkdir -p $(CACHE)/soak
	$(TARGET_DIR)/release/tailwarden-soak --minutes $(SOAK_MINUTES) --workdir $(CACHE)/soak \
	  --report $(CACHE)/soak/report.txt $(SOAK_ARGS)
