PY ?= python3.11
VENV ?= .venv
BIN = $(VENV)/bin
PIP = $(BIN)/python -m pip install -q -c constraints-cpu.txt
MODEL ?= imagebind
GPUS ?= 8
# The demo's training run (tests/test_examples.py runs DEMO_CPU as written here): on a CPU, the
# tiny CLIP on scikit-learn's handwritten digits (real images, zero-shot accuracy at the end);
# on a GPU, the small CLIP on synthetic data.
DEMO_CPU = train clip --preset tiny --data digits --batch 64 --steps 240 --lr 1e-3
DEMO_GPU = train clip --preset small --steps 50
HAS_CUDA = $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"

.PHONY: demo test install install-test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

install: $(BIN)/python
	$(PIP) -e '.[data]'

install-test: $(BIN)/python
	$(PIP) -e '.[test,data]'

demo: install
	$(BIN)/mosaic plan $(MODEL) --gpus $(GPUS) --out runs/plan-$(MODEL)-$(GPUS)
	if $(HAS_CUDA); then $(BIN)/mosaic $(DEMO_GPU) --out runs/demo-clip-small --overwrite; \
	else $(BIN)/mosaic $(DEMO_CPU) --out runs/demo-clip-digits --overwrite; fi

lint: install-test
	$(BIN)/ruff check src tests benchmarks examples

# Two pytest-xdist workers: CI has 2 cores, and most tests use one. Tests that must run in turn
# on one worker (a module's shared runs, the forkserver of tests/helpers.py, Inductor's cache)
# carry @pytest.mark.xdist_group; `slow` ones start first (tests/conftest.py).
test: install-test
	$(BIN)/ruff check src tests benchmarks examples
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) runs .pytest_cache
