# Two commands on a fresh machine: `make demo` (local end-to-end run) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev
PIP    := $(BIN)/pip --disable-pip-version-check --no-input
# make test: three pytest workers more than the cores (tests/conftest.py); about 5.5 minutes on 2 cores (README).
# Serial: PYTEST_ARGS=-n0
# A whole module at a time to whichever worker is free, the costliest modules first (tests/conftest.py).
PYTEST_ARGS ?= -n auto --dist loadscope --no-loadscope-reorder
# pip's progress: one line per package it fetches; errors still go to stderr, and a failed step fails make.
# PYTHONWARNINGS=ignore: setuptools' editable-install banner is noise to a newcomer (it reaches stderr).
SHELL       := bash
.SHELLFLAGS := -o pipefail -c

.PHONY: all venv test lint demo bench mutate lock wheels clean

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
	@# mypy's parallel workers can fail to start on a loaded machine ("Failed to establish connection with
	@# worker": an internal error, not a finding); one serial run then decides. A real type error fails both.
	$(BIN)/mypy || MYPY_NUM_WORKERS=0 $(BIN)/mypy

# Python's bytecode cache on (some images set PYTHONDONTWRITEBYTECODE): every xdist worker would otherwise
# rewrite and compile all 170-odd test modules again, and every agent and trainer the tests start would
# compile the project's modules again.
test: lint
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/python -m demo

bench: $(STAMP)
	$(BIN)/python -m bench

# Mutation testing of the guarantee modules (bench/mutate.py; not part of `make test`: tens of minutes on
# 2 cores). Runs in a private copy under /tmp, niced. One target: make mutate MUTATE_ARGS=persist
MUTATE_ARGS ?=
mutate: $(STAMP)
	nice -n 10 $(BIN)/python -m bench.mutate $(MUTATE_ARGS)

# The instance's boot-time Python packages (bootstrap/requirements-instance.txt) and the dev box's CLI
# packages (bootstrap/devbox/requirements-cli.txt), pinned with every file's sha256: install-agent.sh and
# install-cli.sh install them with --require-hashes --only-binary=:all:. Needs PyPI; run after editing
# either requirements file and commit the locks. pip-tools runs from a throwaway venv under build/.
# The check downloads every pinned wheel for the DLAMI's CPython (3.12, and 3.11 for older DLAMIs) on
# x86_64 manylinux, so a lock that would not install there fails here. Never lists torch or torchvision.
LOCK_IN        := bootstrap/requirements-instance.txt
LOCK_OUT       := bootstrap/requirements-instance.lock.txt
# The dev box's trainstack CLI (rich and its dependencies), installed into its own venv on the box.
CLI_LOCK_IN    := bootstrap/devbox/requirements-cli.txt
CLI_LOCK_OUT   := bootstrap/devbox/requirements-cli.lock.txt
LOCK_ENV       := build/lock-env
PYPI           := https://pypi.org/simple
INSTANCE_PYTHON ?= 3.12
# Ubuntu 24.04 has glibc 2.39; pip does not widen --platform to older manylinux tags, so each one is named.
MANYLINUX      := $(foreach g,39 35 34 31 28 27 24 17 12 5,--platform manylinux_2_$(g)_x86_64) \
		--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
PIP_OFFLINE_ENV := env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null
lock:
	$(PYTHON) -m venv $(LOCK_ENV)
	$(LOCK_ENV)/bin/pip install --quiet pip-tools==7.6.2
	for pair in $(LOCK_IN):$(LOCK_OUT) $(CLI_LOCK_IN):$(CLI_LOCK_OUT); do \
		CUSTOM_COMPILE_COMMAND='make lock' $(PIP_OFFLINE_ENV) $(LOCK_ENV)/bin/pip-compile --quiet --generate-hashes \
			--strip-extras --no-emit-index-url --index-url $(PYPI) --output-file $${pair#*:} $${pair%%:*} || exit 1; \
	done
	for version in 3.12 3.11; do for lock in $(LOCK_OUT) $(CLI_LOCK_OUT); do \
		rm -rf build/lock-check && $(PIP_OFFLINE_ENV) $(LOCK_ENV)/bin/pip download --quiet --index-url $(PYPI) \
			--require-hashes --only-binary=:all: --no-deps $(MANYLINUX) --implementation cp \
			--python-version $$version -d build/lock-check -r $$lock || exit 1; \
	done; done
	! grep -Eiq '^(torch|torchvision)==' $(LOCK_OUT) $(CLI_LOCK_OUT)

# trainstack:networkIsolation: the instances cannot reach PyPI, so `pulumi up` uploads these wheels to the
# stack's bucket (code/wheels/) and install-agent.sh installs them offline; pip checks each against the lock.
wheels: $(STAMP)
	rm -rf build/wheels/instance
	$(PIP_OFFLINE_ENV) $(BIN)/pip download --quiet --index-url $(PYPI) --require-hashes --only-binary=:all: \
		--no-deps $(MANYLINUX) --implementation cp --python-version $(INSTANCE_PYTHON) \
		-d build/wheels/instance -r $(LOCK_OUT)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .demo
