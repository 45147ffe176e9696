PY ?= python3.11
VENV ?= .venv
BIN = $(VENV)/bin
PIP = $(BIN)/python -m pip install -q -c constraints-cpu.txt
MODEL ?= imagebind
GPUS ?= 8

.PHONY: demo test install install-test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

install: $(BIN)/python
	$(PIP) -e '.[solver]'

install-test: $(BIN)/python
	$(PIP) -e '.[solver,test]'

demo: install
	$(BIN)/mosaic plan $(MODEL) --gpus $(GPUS) --out runs/plan-$(MODEL)-$(GPUS)

lint: install-test
	$(BIN)/ruff check src tests benchmarks examples

test: install-test
	$(BIN)/ruff check src tests benchmarks examples
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
