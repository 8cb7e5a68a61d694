# Two entry points for a fresh machine: `make demo` and `make test`.
# Both build .venv on first use. torch is pinned to the CPU build that pip
# finds locally, so the multi-GB CUDA wheels are never downloaded.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0

.PHONY: demo test bench clean

$(BIN)/rankwatch: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[all,test]'
	touch $@

demo: $(BIN)/rankwatch
	$(BIN)/rankwatch demo

test: $(BIN)/rankwatch
	$(BIN)/python -m pytest

bench: $(BIN)/rankwatch
	$(BIN)/python bench/ingest.py

clean:
	rm -rf $(VENV) rankwatch-data .pytest_cache
