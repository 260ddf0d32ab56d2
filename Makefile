# Two commands on a fresh machine: `make demo` (local end-to-end run) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev
PIP    := $(BIN)/pip --disable-pip-version-check --no-input
# make test: one pytest worker per core plus one (tests/conftest.py); about 4 minutes on 2 cores.
# Serial: PYTEST_ARGS=-n0
PYTEST_ARGS ?= -n auto --dist worksteal
# pip's progress: one line per package it fetches; errors still go to stderr, and a failed step fails make.
# PYTHONWARNINGS=ignore: setuptools' editable-install banner is noise to a newcomer (it reaches stderr).
SHELL       := bash
.SHELLFLAGS := -o pipefail -c

.PHONY: all venv test lint demo bench clean

all: test

$(STAMP): pyproject.toml constraints-dev.txt
	@echo "==> $(VENV): installing trainstack, PyTorch and the dev tools (first run: about 2 minutes, 6 GB)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) install --quiet --upgrade pip
	@PYTHONWARNINGS=ignore $(PIP) install --progress-bar off -c constraints-dev.txt -e '.[dev]' \
		| awk '/^Collecting /{print "    " $$2; fflush()} /^Successfully installed/{print "==> $(VENV) ready"}'
	@touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/python -m demo

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .demo
