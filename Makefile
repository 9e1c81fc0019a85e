# tailwarden: the two commands a new user needs are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
CACHE := $(CURDIR)/.cache

.PHONY: all build test unit lint fmt fmt-check crds crds-check clippy

all: build

build:
	$(CARGO) build --workspace --bins

## test: everything CI runs — formatting, lints, unit and integration tests.
test: fmt-check clippy unit

unit:
	$(CARGO) test --workspace --no-fail-fast

## lint: formatting and clippy, warnings are errors.
lint: fmt-check clippy

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

fmt-check:
	$(CARGO) fmt --all -- --check

## crds: regenerate crds/inferenceroute.yaml from the Rust types (a test fails on drift).
crds:
	$(CARGO) run -q -p tailwarden-operator -- crd > crds/inferenceroute.yaml
