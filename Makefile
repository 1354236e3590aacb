# Sluice: two commands on a fresh machine with Python 3.11+ and make.
#   make run   - the whole platform on embedded defaults (SQLite, embedded Redis, simulated pool)
#   make test  - the test suite against PostgreSQL and Redis (DATABASE_URL / REDIS_URL)

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Tests talk to real services; these defaults match the CI machine.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15

.PHONY: run test bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m llm_platform.run

test: $(STAMP)
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} REDIS_URL=$${REDIS_URL:-$(TEST_REDIS_URL)} \
		CELERY_BROKER_URL= $(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) var bench/out
