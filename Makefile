# Sluice: two commands on a fresh machine with Python 3.11+ and make.
#   make run   - the whole platform on embedded defaults (SQLite, embedded Redis, simulated pool)
#   make test  - the test suite against PostgreSQL and Redis (DATABASE_URL / REDIS_URL)
#   make lock  - refresh requirements.lock from pyproject.toml (UPGRADE=1: newest allowed versions;
#                PACKAGE=name: bump that one only)

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOCK := requirements.lock
# The lock's own tool, pinned, in a venv of its own (never in the project's).
PIP_TOOLS := pip-tools==7.6.2
LOCK_VENV := .venv-lock

# Tests talk to real services; these defaults match the CI machine.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15

.PHONY: run test bench install lock clean

# Every package, direct and transitive, comes from the lock with its hashes;
# the project itself is installed on top without resolving anything again.
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes --no-deps -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $(STAMP)

install: $(STAMP)

lock:
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install --quiet "$(PIP_TOOLS)"
	$(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links \
		--extra test --extra bench $(if $(UPGRADE),--upgrade) $(if $(PACKAGE),--upgrade-package $(PACKAGE)) \
		--output-file $(LOCK) pyproject.toml

run: $(STAMP)
	$(PY) -m llm_platform.run

test: $(STAMP)
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} REDIS_URL=$${REDIS_URL:-$(TEST_REDIS_URL)} \
		CELERY_BROKER_URL= $(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) $(LOCK_VENV) var bench/out
