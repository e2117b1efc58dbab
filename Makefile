# The README's two commands. Each bootstraps .venv on its own, installing exactly
# requirements.lock (every package at its version, checked against its hashes): uv when it can,
# pip otherwise. `make lock` resolves pyproject.toml again and rewrites the lock.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOCK := requirements.lock
# The uv the lock holds, so the installer is pinned by the lock too.
UV_VERSION := $(shell sed -n 's/^uv==\([^ ]*\).*/\1/p' $(LOCK))
PIP := $(PY) -m pip --quiet --disable-pip-version-check

.PHONY: demo test lint bench clean lock

$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), f"Python 3.11+ is required, found {sys.version.split()[0]}"'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) install "uv==$(UV_VERSION)" \
	  && $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) --require-hashes -r $(LOCK) \
	  && $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) --no-deps -e . \
	  || ($(PIP) install --require-hashes -r $(LOCK) && $(PIP) install --no-deps -e .)
	@touch $(STAMP)

# The deployer's and the suite's environment: every Python and platform pyproject.toml allows
# (a laptop, CI, the machine that runs `pulumi up`), exact versions with hashes.
lock: $(STAMP)
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --universal --python-version 3.11 \
	  --generate-hashes --quiet --custom-compile-command "make lock" --output-file $(LOCK)

demo: $(STAMP)
	$(VENV)/bin/multislice demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest --durations=10

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) benchmarks/train_step.py

# The test suite's persistent JAX compilation cache (tests/support/compile_cache.py) goes too.
clean:
	rm -rf $(VENV) .pytest_cache runs "$${XDG_CACHE_HOME:-$$HOME/.cache}/multislice/jax-cache"
