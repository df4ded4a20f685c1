PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --constraint constraints.txt

.PHONY: demo test bench lint mutate install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e .
	touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e ".[dev,hf,bench,baselines]"
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
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
