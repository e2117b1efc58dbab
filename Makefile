# The README's two commands. Each bootstraps .venv on its own (uv when it can, pip otherwise).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), f"Python 3.11+ is required, found {sys.version.split()[0]}"'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --disable-pip-version-check uv \
	  && $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) -e '.[dev]' \
	  || $(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

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
