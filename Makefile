# Developer entry points. Everything runs from .venv/bin, so no activation is needed.
# State (Kafka jars and data, PostgreSQL cluster, logs) lives in OPLEDGER_HOME, outside git.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# pip runs again only when pyproject.toml is newer than this stamp.
STAMP  := $(VENV)/.installed

.PHONY: venv stack demo test lint down

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

stack: venv
	$(BIN)/opledger stack up

demo: venv stack
	$(BIN)/opledger demo

# Any non-zero pytest exit fails the target, including 5 ("no tests collected").
# Tests run in TEST_WORKERS processes (pytest-xdist): most of a test's time is spent waiting on
# processes, the broker and the database, so 3 on 2 cores took the suite from 19 to ~11 minutes.
# Each test has its own topics, database and ports, so they do not see one another.
# `make test TEST_WORKERS=0` runs them in one process.
TEST_WORKERS ?= 3
test: venv stack
	$(BIN)/pytest -q --durations=25 -n $(TEST_WORKERS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

down: venv
	$(BIN)/opledger stack down
