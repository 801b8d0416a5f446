# The two entry points are `make demo` and `make test`; both set the machine up first and are idempotent.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Every Python dependency, pinned and hashed (pip-compile over pyproject.toml + requirements.in).
LOCK := requirements.lock
# The stamp is keyed on the lock's hash, so a dependency change re-installs and nothing else does.
DEPS_HASH := $(shell cat $(LOCK) pyproject.toml | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(DEPS_HASH)
APT_STAMP := $(VENV)/.apt-installed
# pip-tools lives in its own venv so that it is not part of what the lock describes.
TOOLS := .venv-tools
PIP_TOOLS := pip-tools==7.6.2
# `make test-latest` resolves the newest versions pyproject.toml allows into this venv.
VENV_LATEST := .venv-latest
# torch's CPU build comes from this machine's pip configuration (find-links); same pin as the lock's.
TORCH_PIN := $(shell grep -E '^torch==' requirements.in)
PYTEST_ARGS ?=
# Test files run in parallel, one file per worker at a time (`--dist loadfile` keeps a file's shared
# Triton fleet in one worker); most tests wait on the processes they start rather than on the CPU.
TEST_WORKERS ?= 3
LOCK_ARGS ?=
# The gateway's request path compiled with mypyc (gateway/compiled_build.py, docs/gateway.md#compiled-build):
# `compiled` (default) builds it in place; `pure` skips the build, and `make test GATEWAY_BUILD=pure`
# runs the suite on the Python sources even where the extension modules exist.
GATEWAY_BUILD ?= compiled

.PHONY: setup gateway-build demo test test-latest lock lock-upgrade lint bench-training bench-gateway bench-gateway-goals bench-fleet-routing bench-placement bench-cascade chaos clean

setup: $(STAMP) $(APT_STAMP) $(if $(filter compiled,$(GATEWAY_BUILD)),gateway-build)

# Decided by content, as the gateway decides at start-up: the build is redone when any gateway
# source's hash differs from the one recorded at build time or an extension module is missing
# (a check of a few milliseconds otherwise). A lock change re-installs mypy, so it rebuilds too.
gateway-build: $(STAMP) $(APT_STAMP)
	@if [ $(STAMP) -nt gateway/compiled.json ]; then rm -f gateway/compiled.json; fi
	$(BIN)/python scripts/compile_gateway.py --if-stale

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(LOCK) pyproject.toml | $(BIN)/python
	# Exactly the locked versions, each checked against its hash (torch's CPU wheel included);
	# --no-deps because the lock is complete, so pip resolves nothing on its own.
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r $(LOCK)
	# An earlier lock may have installed packages this one no longer names: remove them.
	export LC_ALL=C; extra=$$(comm -23 \
	  <($(BIN)/python -m pip freeze --all --exclude-editable | sed -E 's/[=@ ].*//' | tr 'A-Z_.' 'a-z--' | sort -u) \
	  <(grep -E '^[a-zA-Z0-9]' $(LOCK) | sed -E 's/[=@ ].*//' | tr 'A-Z_.' 'a-z--' | sort -u)); \
	if [ -n "$$extra" ]; then echo "removing packages the lock does not name:" $$extra; \
	  $(BIN)/python -m pip uninstall --quiet -y $$extra; fi
	# The project itself, built by the locked setuptools.
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

# Debian packages the tests use for real: redis-server (shared cache), promtool (rules checks) and
# docker-compose (its `config` validates deploy/compose.yaml against the Compose schema; no engine runs),
# wrk and h2load (nghttp2-client): the C load generators of `make bench-gateway`; valgrind counts the
# gateway's instructions in `make bench-gateway-instructions`; gcc compiles the gateway's request path
# (mypyc's C output).
$(APT_STAMP): Makefile | $(BIN)/python
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v docker-compose >/dev/null || missing="$$missing docker-compose"; \
	command -v wrk >/dev/null || missing="$$missing wrk"; \
	command -v h2load >/dev/null || missing="$$missing nghttp2-client"; \
	command -v callgrind_control >/dev/null || missing="$$missing valgrind"; \
	command -v gcc >/dev/null || missing="$$missing gcc"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "error: missing Debian packages:$$missing; run 'sudo apt-get install$$missing' and retry" >&2; exit 1; \
	  fi; \
	fi
	@# kubectl (kustomize 5) renders deploy/k8s in the tests and `make deploy-check`; neither Debian
	@# (1.20, kustomize 2) nor PyPI carries a usable one, so it comes with the machine (the CI image has it).
	@command -v kubectl >/dev/null || echo "warning: kubectl not found: the deploy tests that render the overlays skip here, and fail under CI=true; install kubectl 1.27+ (https://kubernetes.io/docs/tasks/tools/)" >&2
	touch $@

demo: setup
	$(BIN)/skewserve demo

test: setup
	SKEWSERVE_GATEWAY_BUILD=$(GATEWAY_BUILD) $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=10 $(PYTEST_ARGS)

# The suite against the newest versions pyproject.toml allows (torch stays the CPU build), in a fresh
# venv of its own, so drift shows up here before a fresh install meets it. The lock check is the one
# test that must differ there. It runs the gateway's sources: the compiled build is the lock's.
test-latest: $(APT_STAMP)
	rm -rf $(VENV_LATEST)
	$(PYTHON) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_LATEST)/bin/python -m pip install --quiet '$(TORCH_PIN)'
	$(VENV_LATEST)/bin/python -m pip install --quiet -e '.[dev]'
	@echo "versions that differ from $(LOCK) (locked -> latest):"
	@export LC_ALL=C; norm='{n = tolower($$1); gsub(/[_.]/, "-", n); print n, $$2}'; join -j1 -a1 -a2 -e absent -o 1.2,2.2,0 \
	  <(grep -E '^[a-zA-Z0-9]' $(LOCK) | sed -E 's/ .*//; s/==/ /' | awk "$$norm" | sort -k1,1) \
	  <($(VENV_LATEST)/bin/python -m pip freeze --all --exclude-editable | sed -E 's/==/ /' | awk "$$norm" | sort -k1,1) \
	  | awk '$$1 != $$2 {print "  " $$3 " " $$1 " -> " $$2}'
	SKEWSERVE_GATEWAY_BUILD=pure $(VENV_LATEST)/bin/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=10 --deselect tests/test_lock.py::test_installed_versions_are_the_locked_ones $(PYTEST_ARGS)

$(TOOLS)/bin/pip-compile:
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --upgrade pip '$(PIP_TOOLS)'

# Re-resolve after a change to pyproject.toml or requirements.in; versions already locked are kept
# where they still fit, so adding one dependency does not upgrade the others. `make lock-upgrade`
# moves everything to the newest allowed versions.
lock: | $(TOOLS)/bin/pip-compile
	CUSTOM_COMPILE_COMMAND="make lock" $(TOOLS)/bin/pip-compile --quiet --extra dev --generate-hashes --allow-unsafe --strip-extras \
	  --no-emit-index-url --no-emit-find-links $(LOCK_ARGS) --output-file $(LOCK) pyproject.toml requirements.in
	# The `dev` extra names the project's own extras (skewserve[all]), so pip-compile lists the project
	# itself as `skewserve @ file://...`: drop it (it is installed editable, and cannot be hashed).
	$(TOOLS)/bin/python -c 'import re,sys; p=sys.argv[1]; s=open(p).read(); s=re.sub(r"(# WARNING: pip install will require[^\n]*\n# Consider[^\n]*\n)?skewserve @ file:[^\n]*\n(    #[^\n]*\n)*", "", s); open(p,"w").write(s)' $(LOCK)

lock-upgrade:
	$(MAKE) lock LOCK_ARGS=--upgrade

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench-training: setup
	$(BIN)/python benchmarks/training_bench.py

bench-gateway: setup
	$(BIN)/python benchmarks/gateway_bench.py

# Issue 39's goals in ROUNDS alternating rounds (benchmarks/gateway_goals.py): each ratio's median and range;
# AGAINST=NAME=DIR (one) adds another checkout's gateway to every round; FLEET=N has the gateways route over N
# servers (the one Triton listed N times). About a minute per round on 2 cores.
ROUNDS ?= 5
AGAINST ?=
FLEET ?=
bench-gateway-goals: setup
	$(BIN)/python benchmarks/gateway_goals.py --rounds $(ROUNDS) $(if $(AGAINST),--against $(AGAINST)) $(if $(FLEET),--fleet $(FLEET))

# The gateway's instructions per request under callgrind (benchmarks/gateway_instructions.py): an HTTP cache hit,
# an uncached HTTP request and an uncached gRPC call, unmoved by the machine's load; AGAINST=NAME=DIR: another
# checkout too. About 1.5 minutes a row.
bench-gateway-instructions: setup
	$(BIN)/python benchmarks/gateway_instructions.py $(if $(AGAINST),--against $(AGAINST))

# Routing's per-request cost as the fleet grows (benchmarks/fleet_routing_bench.py); AGAINST=DIR: another checkout too.
bench-fleet-routing: setup
	$(BIN)/python benchmarks/fleet_routing_bench.py $(if $(AGAINST),--against $(AGAINST))

bench-placement: setup
	$(BIN)/python benchmarks/placement_bench.py

# Edge-cloud cascade on digits-LT (docs/cascade.md#benchmark): trains, exports, serves; about 10 minutes.
bench-cascade: setup
	$(BIN)/python benchmarks/cascade_bench.py --out docs

# The control plane under faults (benchmarks/chaos.py): MINUTES of skewed locust traffic through the gateway
# while 5% of storage calls fail, the controller leader is killed every 60 s and a tritonserver every 90 s,
# and a rollout and a rollback run; prints failed requests, unloads of served versions, time to converge
# after each fault and promotions. A benchmark, not a test: its figures go in the README.
MINUTES ?= 10
SEED ?= 0
chaos: setup
	$(BIN)/python benchmarks/chaos.py --minutes $(MINUTES) --seed $(SEED)

clean:
	rm -rf $(VENV) $(VENV_LATEST) $(TOOLS) runs demo-output .pytest_cache build/mypyc gateway/compiled.json
	find gateway -name '*.so' -delete

# What only a CUDA GPU can show (scripts/gpu_check.py, under 8 minutes on one GPU): CUDA training in bf16
# and fp16, TensorRT FP32/FP16 plans with parity, TorchScript and the ONNX Runtime CUDA provider, and the
# tests marked `gpu`. Not tied to `setup`, which installs the CPU build of torch: run it with an interpreter
# holding a CUDA torch, the `gpu` extra and onnxruntime-gpu instead of onnxruntime (docs/export.md#gpu-check).
# Without a usable GPU it exits 3 and says why.
GPU_PYTHON ?= $(BIN)/python
.PHONY: gpu-check
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py

# Every image the Kubernetes overlays run, pinned by digest (deploy/images.py): builds and pushes the
# gateway image to $(REGISTRY), asks the registry for each image's digest (crane, or docker buildx
# imagetools), writes the digests into deploy/k8s/base/kustomization.yaml and prints them.
# BUILD=0 pins what the registry holds without building.
REGISTRY ?=
BUILD ?= 1
.PHONY: images deploy-check
images:
	$(PYTHON) deploy/images.py --registry '$(REGISTRY)' --build $(BUILD)

# Before `kubectl apply`: each overlay rendered by `kubectl kustomize` and checked by the policy rules
# of tests/deploy/policy.py, placeholders refused (digests of zeros, ACCOUNT_ID). `make test` runs
# the same rules on the same overlays, without the release one.
deploy-check: setup
	$(BIN)/python -m tests.deploy.policy --release $(wildcard deploy/k8s/overlays/*)
