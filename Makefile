# Two entry points for a fresh machine: `make demo` and `make test`.
# Both build .venv on first use. torch is pinned to the CPU build that pip
# finds locally, so the multi-GB CUDA wheels are never downloaded.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0

.PHONY: demo test check lint style types test-tools bench clean

$(BIN)/rankwatch: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile $(TORCH) -e '.[all,test]'
	@# the bytecode compiled on every core, where pip compiles on one (80 s for both, 58 s apart); the few files
	@# no Python of this version parses (a package's tests for a newer one) are left, as pip leaves them
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	$(BIN)/python -c 'import collector.receive._otlpwire' || (echo "the C decoder collector/receive/_otlpwire.c did not build: install a C compiler and Python headers"; exit 1)
	touch $@

demo: $(BIN)/rankwatch
	$(BIN)/rankwatch demo

# The tests run three modules at a time (pytest-xdist): most of them wait on real processes and real
# time, so three workers keep two cores busy; a module stays on one worker, its fixtures built once.
# They write bytecode whatever the environment says (PYTHONDONTWRITEBYTECODE): the suite starts
# several hundred Python processes (collectors, ranks, commands), each of which would otherwise compile
# the project's modules again, as each worker would rewrite every test module's asserts again.
# The type check runs beside them: on one core, while pytest starts its workers and collects.
test: style test-tools
	@$(BIN)/mypy & types=$$!; \
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder; tests=$$?; \
	wait $$types && exit $$tests

# The quick loop while editing: the quality gates and the unit tests (modules marked `unit`: pure code on
# small inputs, no processes), well under a minute once the venv is built.
check: lint
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -m unit -q

# The quality gates: lint and format (style), and types (configured in pyproject.toml).
lint: style types

style: $(BIN)/rankwatch
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: $(BIN)/rankwatch
	$(BIN)/mypy

# System packages some tests use (they skip without them): Debian's prometheus brings promtool
# and the server that tests/collector/metrics/test_prometheus.py scrapes the collector with; chromium and its
# driver the headless browser of tests/dashboard/test_dashboard_browser.py; postgresql the catalog database
# of the lake that tests/collector/store/test_lake.py's collectors share. Needs root.
test-tools:
	@command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus) \
		|| echo "prometheus not installed: its tests in tests/collector/metrics/test_prometheus.py will skip"
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || [ "$$(id -u)" != 0 ] \
		|| (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver) \
		|| echo "chromium not installed: tests/dashboard/test_dashboard_browser.py will skip"
	@ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] \
		|| (apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql) \
		|| echo "postgresql not installed: tests/collector/store/test_lake.py will skip"

bench: $(BIN)/rankwatch
	$(BIN)/python bench/ingest.py

clean:
	rm -rf $(VENV) rankwatch-data .pytest_cache
