# The two entry points are `make demo` and `make test`; both set the machine up first and are idempotent.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The stamp is keyed on pyproject.toml, so a dependency change re-installs and nothing else does.
DEPS_HASH := $(shell sha256sum pyproject.toml | cut -c1-16)
STAMP := $(VENV)/.installed-$(DEPS_HASH)
APT_STAMP := $(VENV)/.apt-installed
DEBIAN_PACKAGES := redis-server prometheus
PYTEST_ARGS ?=

.PHONY: setup demo test lint bench-training bench-gateway clean

setup: $(STAMP) $(APT_STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	# torch first, from the CPU build on disk, so the project's range installs nothing bigger.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

# Debian packages the tests use for real: redis-server (shared cache) and promtool (rules checks).
$(APT_STAMP): | $(BIN)/python
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "error: missing Debian packages:$$missing; run 'sudo apt-get install$$missing' and retry" >&2; exit 1; \
	  fi; \
	fi
	touch $@

demo: setup
	$(BIN)/skewserve demo

test: setup
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench-training: setup
	$(BIN)/python benchmarks/training_bench.py

bench-gateway: setup
	$(BIN)/python benchmarks/gateway_bench.py

clean:
	rm -rf $(VENV) runs demo-output .pytest_cache
