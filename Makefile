# Two entry points: `make run` (serve the embedded model) and `make test`.
# Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint format agents bench bench-side bench-smoke model train eval clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,cpu-blas,vision]'
	touch $(STAMP)

# On Linux the server multiplies through a fast BLAS loaded ahead of MLX: the
# system OpenBLAS when installed, else MKL from PyPI (the cpu-blas extra, x86-64).
run: $(STAMP)
	$(BIN)/mlxtrio serve

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Style, types, and the architecture's import contracts (pyproject.toml
# [tool.importlinter]: imports point inward, MLX only under engine/, no cycles).
lint: $(STAMP)
	$(BIN)/ruff check mlxtrio tests benchmarks tools
	$(BIN)/ruff format --check mlxtrio tests benchmarks tools
	$(BIN)/mypy
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format mlxtrio tests benchmarks tools
	$(BIN)/ruff check --fix mlxtrio tests benchmarks tools

# The release check with real agents (not part of `make test`): the agent CLIs,
# pinned to the versions `mlxtrio launch` was checked against, in a private
# prefix; each drives the embedded model headless through scripted tasks and
# one line per client says how it went (tools/agents.py).
AGENT_PACKAGES = @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 opencode-ai@1.18.33
agents: $(STAMP)
	npm install --prefix build/agents --no-audit --no-fund $(AGENT_PACKAGES)
	$(BIN)/python tools/agents.py

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_overhead.py

# mlx_lm.server and mlxtrio side by side (about half an hour on 2 cores); results,
# tables and plots in benchmarks/results/. bench-smoke: the same in a minute or
# two with tiny sizes, to check the script still runs (figures meaningless).
bench-side: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python benchmarks/side_by_side.py

bench-smoke: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python benchmarks/side_by_side.py --smoke --models embedded --out build/bench-smoke

# Rebuild the embedded model's tokenizer, config and random weights (seeded).
model: $(STAMP)
	$(BIN)/python tools/build_embedded_model.py --seed 0

# Train the embedded model (PyTorch on the CPU; on a 2-core AMX machine 36.6
# minutes for the base and 7.1 for the fine-tune; see the README), then evaluate
# it on held-out prompts as the server runs it (tool names constrained) and raw.
# Reproducible from the seed. The base learns the chat format and to read the
# tools, its first 1500 steps with bf16 products in the MLP and attention's
# projections (faster; run 27), the rest in float32 (bf16 to the end cost the
# selection of tools: runs 18, 19, 26); the fine-tune puts real-world text in half
# its prompts so that agent clients' long system prompts do not derail it, and
# softens attention at random so that 34k-token prompts do not dilute it (run 23).
TRAIN_FLAGS = --seed 0 --variety --compile --prompt-weight 0.1 --copy-samples 15000 \
	--description-first --call-weight 3 --name-weight 6 --skip-ratio 0.5 --probe-every 300
BASE_FLAGS = --copy-warmup 600 --prev-token-init --steps 2700 --lr 2e-3 --warmup-lr 1.2e-3 \
	--bf16 mlp,proj --bf16-steps 1500
FINETUNE_FLAGS = --steps 300 --lr 5e-4 --foreign-ratio 0.5 --foreign-chars 4000 --soften 0.5
train: $(STAMP)
	$(BIN)/python -m pip install --quiet 'torch==2.13.0' safetensors
	$(BIN)/python tools/train_tiny_model.py $(TRAIN_FLAGS) $(BASE_FLAGS) --out build/tiny-base
	$(BIN)/python tools/train_tiny_model.py $(TRAIN_FLAGS) $(FINETUNE_FLAGS) \
		--init-from build/tiny-base
	$(BIN)/python tools/eval_tiny_model.py --constrained --long 0
	$(BIN)/python tools/eval_tiny_model.py

eval: $(STAMP)
	$(BIN)/python tools/eval_tiny_model.py --constrained --long 0
	$(BIN)/python tools/eval_tiny_model.py

clean:
	rm -rf $(VENV) .pytest_cache
