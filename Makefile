# Two entry points: `make demo` (score the bundled examples with the default model) and `make test`.
# Both create or reuse .venv, install torch first and alone, then the pinned dependencies and halwatch, then pull
# the default scoring model into $HALWATCH_HOME (default ~/.cache/halwatch).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.halwatch-installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test test-models test-extras install model browser polygraph ray clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -r requirements.lock
	$(PIP) install --no-deps -e .
	touch $(STAMP)

model: install
	$(BIN)/halwatch models pull smollm2-135m

demo: model
	$(BIN)/halwatch score --input src/halwatch/examples/demo.jsonl --output -

# The tests also need Gemma 3 270M (a second real model) and Debian's Chromium (the web page in a headless browser).
# They run in two pytest-xdist workers of one torch thread each (a file's tests in one worker, so that a module's
# server, database or Ray cluster starts once). On a 2-core machine a clean clone took 23.6 to 25.8 minutes in all
# (set-up 4.1 to 4.5, pytest 19.5 to 21.3): d706d10, da1cf06 and 4b271ac, 2026-11-28 (d08a45a: 28.0 minutes, with a
# probe of longer prompts; runs of one commit differ by up to 10 %); on the 2-core machine of 2026-11-29, 14.8 and
# 12.5 minutes (pytest 12.8 and 10.2): 9e8b5b4 and 218aa60; on a 2-core Zen 4 EPYC, 21.2 minutes (pytest 17.3):
# 50f25e8, 2026-12-02, and 14.8 and 15.0 (pytest 12.5 each): d648beb and f5ba311, 2026-12-03. Machines differ by
# 2x: keep the suite well inside 25.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

browser:
	test -x /usr/bin/chromium || $(SUDO) apt-get install -y -q chromium || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)

# The optional extra `polygraph` (LM-Polygraph's estimators, the polygraph:NAME detectors), which the tests need: not in
# requirements.lock, so that `make demo` stays small; installed once (skipped when that version is there). Its
# resolver keeps torch==2.13.0 and every locked version, and adds about 90 packages.
POLYGRAPH := lm-polygraph==0.7.0

polygraph: install
	$(BIN)/python -c "import importlib.metadata as m, sys; sys.exit(m.version('lm-polygraph') != '0.7.0')" \
		2>/dev/null || $(PIP) install $(POLYGRAPH)

# The optional extra `ray` (Ray Data: halwatch score --ray, halwatch bench --ray), which the tests need; installed once.
RAY := ray[data]==2.60.0

ray: install
	$(BIN)/python -c "import importlib.metadata as m, sys; sys.exit(m.version('ray') != '2.60.0')" \
		2>/dev/null || $(PIP) install "$(RAY)"

# Two lanes: the models convert (CPU) while the extras install (network and disk), one after another in each lane.
test: install
	$(MAKE) -j2 test-models test-extras
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=40

test-models: model
	$(BIN)/halwatch models pull gemma3-270m

test-extras: install  # one at a time: two pip installs must not write into the same .venv at once
	$(MAKE) browser
	$(MAKE) polygraph
	$(MAKE) ray

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
