# The verbs of the README. `make serve` and `make test` work from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.serve-installed
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints-dev.txt
PYTEST_ARGS ?=
# The test runs' worker processes (pytest-xdist; a worker that runs out of tests takes half of
# another's): much of the suite waits on the services, Redis and trainers it starts, so two
# workers fill two cores. TEST_WORKERS=0 runs the tests in one process, in order.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist worksteal

.PHONY: install serve test test-unit test-installs test-deps bench demo lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt clients/python/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The client first: the service depends on it (advantage-client, not fetched from an index).
	$(BIN)/python -m pip install --quiet -c constraints-dev.txt -e clients/python
	$(BIN)/python -m pip install --quiet -c constraints-dev.txt -e '.[dev]'
	# verl for the OTB parity tests, without its dependencies (ray[default], wandb, peft, a
	# transformers range, ...): the tests import only its core_algos, whose needs the dev extra has
	$(BIN)/python -m pip install --quiet --no-deps verl==0.9.1
	touch $(STAMP) $(SERVE_STAMP)

# What serving needs and nothing else (no test, lint or trainer libraries); the development
# environment of `make install` has it too.
$(SERVE_STAMP): pyproject.toml constraints-dev.txt clients/python/pyproject.toml
	@echo "make serve: preparing $(VENV) with what serving needs (torch for the CPU, FastAPI, gRPC, Redis client)"
	@test -x $(BIN)/python || { echo "  [1/3] creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "  [2/3] the client package (the service's gRPC modules and batch builder)"
	@$(PIP) -e clients/python
	@echo "  [3/3] the service and its runtime dependencies (torch is the large one: a few minutes on a first install)"
	@$(PIP) -e .
	@touch $@
	@echo "make serve: ready ($$(du -sh $(VENV) | cut -f1) in $(VENV))"

serve: $(SERVE_STAMP)
	$(BIN)/advantage-service serve

# Real services the tests start themselves (on free ports, in temporary directories):
# redis-server (single nodes and Redis Clusters; redis-cli joins them), haproxy (replicas behind
# a load balancer), prometheus with its promtool (the observability tests), and a headless
# chromium with its chromedriver (the viewer's browser tests; Selenium uses the driver on PATH).
test-deps:
	@missing=""; \
	{ command -v redis-server && command -v redis-cli; } >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v haproxy >/dev/null 2>&1 || missing="$$missing haproxy"; \
	{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (OS packages)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

test: install test-deps
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# Every install command of the README and docs/ in a clean virtual environment, then its example
# (cached under ~/.cache/advantage-service: a cold cache takes about 25 minutes, a warm one 1).
test-installs: install
	$(BIN)/python -m pytest -q -m installs tests/installs $(PYTEST_ARGS)

# The quick loop: the tests that start no process (no service, Redis, browser or trainer run;
# those are marked `integration`). A test that starts one without the marker fails here.
test-unit: install
	ADV_UNIT_ONLY=1 $(BIN)/python -m pytest -q $(XDIST) -m "not integration" $(PYTEST_ARGS)

bench: install
	$(BIN)/python bench/bench_estimators.py
	$(BIN)/python bench/bench_token_methods.py
	$(BIN)/python bench/bench_new_methods.py
	$(BIN)/python bench/bench_grpc.py
	$(BIN)/python bench/bench_http.py
	$(BIN)/python bench/bench_stats.py
	$(BIN)/python bench/bench_load.py
	$(BIN)/python bench/bench_trainers.py
	$(BIN)/python bench/bench_fleet.py
	$(BIN)/python bench/bench_merge.py
	$(BIN)/python bench/bench_cluster.py

# The learning demo (README, "A learning demo"): the tiny TRL model trained with GRPO and with
# KTAE (history per prompt) through a service it starts; writes trl_demo.png and trl_demo.json.
DEMO_OUT ?= demo-out
DEMO_STAMP := $(VENV)/.demo-installed
# What the demo needs and nothing more: the serving environment, TRL (torch as pinned) and
# matplotlib for the plot.
$(DEMO_STAMP): $(SERVE_STAMP) clients/python/pyproject.toml
	@echo "make demo: adding TRL and matplotlib to $(VENV)"
	@$(PIP) -e 'clients/python[trl]' matplotlib
	@touch $@

demo: $(DEMO_STAMP)
	$(BIN)/python clients/examples/trl_demo.py --start-service --out $(DEMO_OUT)

lint: install
	$(BIN)/ruff check service tests bench clients/python
	$(BIN)/ruff format --check service tests bench clients/python
	$(BIN)/mypy
	cd clients/python && $(abspath $(BIN))/mypy

format: install
	$(BIN)/ruff format service tests bench clients/python
	$(BIN)/ruff check --fix service tests bench clients/python

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
