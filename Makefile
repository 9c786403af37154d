# Two entry points: `make run` (serve the embedded model) and `make test`.
# Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint format bench model train eval clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# On Linux the server loads the system OpenBLAS when it is installed (Debian/Ubuntu:
# apt-get install libopenblas0-pthread) and then computes several times faster.
run: $(STAMP)
	$(BIN)/mlxtrio serve

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check mlxtrio tests benchmarks tools
	$(BIN)/ruff format --check mlxtrio tests benchmarks tools
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format mlxtrio tests benchmarks tools
	$(BIN)/ruff check --fix mlxtrio tests benchmarks tools

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_overhead.py

# Rebuild the embedded model's tokenizer, config and random weights (seeded).
model: $(STAMP)
	$(BIN)/python tools/build_embedded_model.py --seed 0

# Train the embedded model (PyTorch on the CPU: about 50 minutes on the 2-core
# machine it was trained on, far longer on CPUs without native bfloat16; see the
# README),
# then evaluate it on held-out prompts. Reproducible from the seed.
train: $(STAMP)
	$(BIN)/python -m pip install --quiet 'torch==2.13.0' safetensors
	$(BIN)/python tools/train_tiny_model.py --seed 0
	$(BIN)/python tools/eval_tiny_model.py

eval: $(STAMP)
	$(BIN)/python tools/eval_tiny_model.py

clean:
	rm -rf $(VENV) .pytest_cache
