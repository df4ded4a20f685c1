PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --constraint constraints.txt

.PHONY: demo test bench lint docs dist check-wheel check-wheel-extras mutate install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e .
	touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e ".[dev,hf,bench,baselines,examples,zstd]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	$(BIN)/comera demo

test: install-dev
	$(BIN)/python -m pytest

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/import_graph.py src/comera > /dev/null
	$(BIN)/mypy

# The documentation site (mkdocs.yml: docs/*.md and the API reference from the docstrings) in site/; --strict:
# a warning (a docstring griffe cannot parse, a broken link or anchor) fails the build. NO_MKDOCS_2_WARNING
# quiets mkdocs-material's notice about MkDocs 2.0.
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The wheel and sdist of a release, in dist/, checked by twine.
dist: install-dev
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*

# The wheel installed into a fresh virtual environment and run there (tools/check_wheel.sh, part of CI);
# check-wheel-extras also installs each optional extra into a fresh environment of its own (a few minutes).
CHECK_WHEEL := BUILD_PYTHON=$(BIN)/python BASE_PYTHON=$(PYTHON) tools/check_wheel.sh
check-wheel: install-dev
	$(CHECK_WHEEL)

check-wheel-extras: install-dev
	$(CHECK_WHEEL) --extras

bench: install-dev
	$(BIN)/comera bench layers --write docs/benchmarks.md
	$(BIN)/comera bench embedding --write docs/benchmarks.md
	$(BIN)/comera bench embedding --memory default --distributions uniform \
		--methods nn.Embedding naive split auto published published+unique \
		--write docs/benchmarks.md --section embedding-glibc
	$(BIN)/comera bench inference --write docs/benchmarks.md
	$(BIN)/comera bench trainer --threads 2 --write docs/benchmarks.md
	$(BIN)/comera bench transformer --threads 2 --write docs/benchmarks.md
	$(BIN)/comera bench paper --out runs/bench-paper --write docs/benchmarks.md

# Mutation testing ([tool.mutmut] in pyproject.toml); slow, not part of `make test`. A subset of the mutants:
# make mutate MUTANTS='comera.atomic.*'
MUTANTS ?=
mutate: install-dev
	$(PIP) "mutmut>=3.8,<4"
	OMP_NUM_THREADS=1 $(BIN)/mutmut run $(MUTANTS)
	$(BIN)/mutmut results

clean:
	rm -rf $(VENV) build dist site src/*.egg-info .pytest_cache
