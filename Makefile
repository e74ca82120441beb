# Two entry points: `make demo` (score the bundled examples with the default model) and `make test`.
# Both create or reuse .venv, install torch first and alone, then the pinned dependencies and halwatch, then pull
# the default scoring model into $HALWATCH_HOME (default ~/.cache/halwatch).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.halwatch-installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test install model clean

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

test: model
	$(BIN)/python -m pytest -q --durations=15

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
