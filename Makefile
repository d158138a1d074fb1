# gpulab developer entry points (README). Each target is a thin alias; the work is
# in portal/stack/ (embedded PostgreSQL/Redis, the `make up` supervisor).
#
#   make up          portal, worker, beat, simulated agents on http://127.0.0.1:8000 (PORT=)
#   make test        the whole pytest suite, a worker per core (PYTEST_ARGS="-k foo -x"
#                    to narrow it, TEST_WORKERS=0 for one process);
#                    installs Debian's Chromium for the browser tests when root
#   make bench       every bench/*.py, results under bench/results/
#   make lint        ruff check + ruff format --check + the layer contracts
#   make typecheck   mypy --strict
#   make migrate     apply migrations (embedded servers started if URLs are unset)
#   make clean       remove the venv stamp and caches; state in var/ is KEPT
#
# PYTHON=python3.11 picks the interpreter that creates .venv (must be 3.11).
# DATABASE_URL / REDIS_URL point at your own servers; unset, embedded ones start.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3 2>/dev/null)
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 8000
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: one per core; TEST_WORKERS=0 runs in-process.
# Tests go to workers one by one (--dist load): schemathesis gives its operations
# one node id, which the by-file modes would run only once. The slowest 25 tests
# are listed at the end of the run (CI's log shows where the time goes).
TEST_WORKERS ?= auto
export PORT

.PHONY: help up test bench lint typecheck migrate clean venv chromium

help:
	@sed -n '3,15p' Makefile | sed 's/^# \{0,1\}//'

$(VPY):
	@if [ -z "$(PYTHON)" ]; then \
		echo "gpulab: no python3.11 or python3 on PATH; install Python 3.11 or run 'make PYTHON=/path/to/python3.11 ...'" >&2; exit 1; fi
	@v=$$("$(PYTHON)" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); \
	case "$$v" in [0-9]*.[0-9]*) ;; *) v="";; esac; \
	if [ "$$v" != "3.11" ]; then \
		echo "gpulab: $(PYTHON) is Python $${v:-?}; gpulab needs Python 3.11 (Django 5.2 LTS pins)." >&2; \
		echo "        Install it (e.g. 'pyenv install 3.11') and run 'make PYTHON=python3.11 ...'" >&2; exit 1; fi
	"$(PYTHON)" -m venv $(VENV)

# Reinstall only when pyproject.toml changed since the last install.
$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -e '.[test,dev]'
	@touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(VPY) -m portal.stack.up

test: $(STAMP) chromium
	$(VPY) -m portal.stack.run -- $(VPY) -m pytest -n $(TEST_WORKERS) --dist load --durations=25 $(PYTEST_ARGS)

# The browser tests drive Debian's Chromium through Playwright (which never
# downloads a browser here). Installed with apt when we are root (as .ci/run
# does); otherwise a missing browser stops `make test` with the package named:
# those tests would fail, never be skipped.
chromium:
	@if ! command -v chromium >/dev/null 2>&1; then \
		if [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "gpulab: installing Chromium for the browser tests (apt: chromium chromium-driver)"; \
			DEBIAN_FRONTEND=noninteractive apt-get update -q && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver || exit 1; \
		else \
			echo "gpulab: the browser tests need Chromium: install the Debian package 'chromium' (with 'chromium-driver'), e.g. 'sudo apt-get install chromium chromium-driver', then run make test again" >&2; \
			exit 1; \
		fi; \
	fi

bench: $(STAMP)
	@mkdir -p bench/results
	@shopt -s nullglob; scripts=(bench/*.py); \
	if [ $${#scripts[@]} -eq 0 ]; then echo "gpulab: no benchmarks in bench/ yet"; exit 0; fi; \
	for s in "$${scripts[@]}"; do \
		name=$$(basename "$$s" .py); \
		echo "== $$s -> bench/results/$$name.txt"; \
		$(VPY) -m portal.stack.run -- $(VPY) "$$s" --out-dir bench/results 2>&1 | tee "bench/results/$$name.txt"; \
		test $${PIPESTATUS[0]} -eq 0 || exit 1; \
	done

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VPY) -m portal.stack.run -- $(VENV)/bin/mypy portal scheduler agents

migrate: $(STAMP)
	$(VPY) -m portal.stack.run -- $(VPY) manage.py migrate --noinput

clean:
	rm -rf $(STAMP) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
	@echo "gpulab: var/ (embedded databases, secret key, agent tokens) kept; 'rm -rf var' to reset the demo"
