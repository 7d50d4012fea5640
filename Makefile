# The README's two commands: `make demo` and `make test`. Each sets itself up on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: venv test lint demo demo-stop bench clean wheel

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# Our modules' bytecode, written once: an editable install writes none, and where
	# PYTHONDONTWRITEBYTECODE is set every command would compile them again at its start.
	$(BIN)/python -m compileall -q comfy_assets fake_comfy > /dev/null
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/python -m comfy_assets.cli.demo $(if $(KEEP),--keep,) $(if $(PORT),--port $(PORT),)

demo-stop: $(STAMP)
	$(BIN)/python -m comfy_assets.cli.demo --stop

# The package as a wheel, for a Dagster project of your own (docs/dagster.md):
# dist/comfy_assets-<version>-py3-none-any.whl. Needs only Python and pip; pip fetches the
# build backend (setuptools) for its isolated build.
wheel:
	$(PYTHON) -m pip wheel --quiet --no-deps --wheel-dir dist .

clean:
	rm -rf $(VENV) .demo .pytest_cache .ruff_cache dist build
