"""Every default of the command line, declared once."""

from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
DATA_DIR = Path("data")
TOKENIZER = CHECKPOINTS / "tokenizer.json"
TARGET = CHECKPOINTS / "target.safetensors"
MTP = CHECKPOINTS / "mtp.safetensors"
PROMPTS = Path(__file__).resolve().parent.parent / "prompts" / "kjv-val-32.jsonl"
# `bench --batch`: 64 held-out prompts of 32 tokens (`smallem prompts --count 64`)
BATCH_PROMPTS = PROMPTS.with_name("kjv-val-32x64.jsonl")

# The proposer used when none is named, per mode: greedy text repeats itself, so the n-gram lookup
# (backed by the MTP module) guesses it for free; sampled text rarely does (docs/benchmarks.md,
# "The n-gram proposer").
PROPOSER = {"greedy": "ngram+mtp", "sample": "mtp"}
PROPOSER_HELP = (
    f"none|ngram|draft-2l|draft-4l|mtp|PATH|ngram+P [default: {PROPOSER['greedy']} greedy, "
    f"{PROPOSER['sample']} sampled; HF: none]"
)
# Default k per proposer, (greedy, sampled): the best of `bench --sweep-k` on the native engine
# (docs/benchmarks.md, "The default k"). Read through `default_k`.
K = {"draft-2l": (4, 3), "draft-4l": (4, 2), "mtp": (4, 3), "ngram": (4, 4)}
K_OTHER = 3  # a proposer given by path
# The n-gram lookup: the last NGRAM_MAX..NGRAM_MIN tokens looked up in the text so far, longest
# first (a 1-gram matches almost always and guesses badly).
NGRAM = "ngram"
NGRAM_MIN = 2
NGRAM_MAX = 4
# What one more token adds to a verify pass, in one-token passes: the n-gram lookup weighs it against
# its acceptance to choose how many guesses to offer (docs/benchmarks.md, "Pass costs").
NGRAM_GUESS_COST = 0.16
# Token trees (`--tree N`, MTP only; 0: the chain): N guesses, grown from each node's TREE_WIDTH best
# tokens and each level's TREE_WIDTH best nodes (`engine.tree_guess`). A sampled request's nodes get
# TREE_DRAWS children drawn from q (verified by SpecInfer's rule), leaving room for more depth.
TREE = 0
TREE_WIDTH = 4
TREE_DRAWS = 2
TREE_HELP = "token trees of N guesses per round, k levels deep (MTP only; 0 = a chain)"
MAX_TREE = 64


def default_k(proposer: str, greedy: bool, k: int | None = None) -> int:
    """The user's k where given, else the proposer's default for the mode (`K`; `ngram+P` and a bench
    row's variant of P, `P@tree12`, as P); `none` proposes nothing (0, whatever k)."""
    if proposer == "none":
        return 0
    if k is not None:
        return k
    name = proposer.removeprefix(NGRAM + "+").split("@")[0]
    return K[name][0 if greedy else 1] if name in K else K_OTHER


MAX_K = 16
# Below this, logits / temperature overflow float32 and the distribution becomes NaN: 0 is greedy.
MIN_TEMPERATURE = 1e-3
MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes
MAX_NEW_TOKENS = 200
# `bench`: timed runs per configuration (the median is reported), and the sampled mode's temperature
BENCH_REPEATS = 3
BENCH_TEMPERATURE = 1.0
# `train`: the defaults of every member's training (`train.TrainSettings`)
TRAIN_SECONDS = 600.0
TRAIN_BATCH = 16
TRAIN_SEQ_LEN = 256
TRAIN_LR = 2e-3
TRAIN_SEED = 1234
TRAIN_MTP_WEIGHT = 0.3  # `train target`: its MTP module's loss weight (DeepSeek-V3's lambda, 0.3 for most of its run)
# `train --compile` (the loss through inductor, ~30 s cold) and `--precision bf16` (bfloat16
# autocast; docs/family.md): off by default, asked for by the Makefile's recipe.
TRAIN_COMPILE = False
TRAIN_PRECISION = "fp32"
TEMPERATURE = 0.0
SEED = 0
DEVICE = "auto"
MAX_BATCH = 16  # `smallem batch`: requests decoded together, at most (more wait for a place)
# `smallem batch`: a request line's bytes before its `\n`, at most (`batch_io.max_line_bytes`); a
# longer one is answered with an error, never read whole nor tokenized (a 50 MB line took 10 GB in
# the tokenizer to be refused). 1 MiB is far past the shipped context; a target of a longer one gets
# LINE_BYTES_PER_TOKEN bytes a position (a JSON escape such as \u00e9 is 6 bytes).
MAX_LINE_BYTES = 1 << 20
LINE_BYTES_PER_TOKEN = 64
# The batch engine's K/V cache (`engine.build.cache_budget`) takes at most this share of the memory
# free (the GPU's, or the machine's), the rest left to the activations; a larger --max-batch is
# lowered to what fits at the full context (`bench --batch` refuses it).
CACHE_MEMORY_SHARE = 0.5
# Decode steps (`engines`): "native" (C++ over float16 weights, AVX-512 where the CPU has it),
# "native-avx2" (to compare), "eager" (PyTorch: the reference, and the GPU's); "auto":
# $SMALLEM_ENGINE where set, else native on a CPU and eager elsewhere.
ENGINE = "auto"
COST_PASSES = (1, 2, 3, 4, 5, 8, 16)  # `bench --costs`: v for passes over these many tokens
# A proposer's head keeps the rows of this many most frequent tokens (0: all): a greedy guess outside
# the top 1,024 is rare, but a sampled one is drawn from q, whose mass outside the cut no guess takes.
PROPOSER_VOCAB = {"greedy": 1024, "sample": 2048}

# How the native engine stores a proposer's matrices (`--proposer-weights`): "int8" (per-row scales:
# half the bytes a guess reads, for about the same acceptance; docs/benchmarks.md, "A proposer's
# matrices as int8") or "f16", its own values (`native.narrowest`). The target's are always its own.
PROPOSER_WEIGHTS = "int8"
WEIGHTS = ("int8", "f16")
WEIGHTS_HELP = f"int8 | f16: how the native engine stores the proposer's matrices [default: {PROPOSER_WEIGHTS}]"
EVAL_TEMPERATURES = (1.0, 0.7)  # `smallem eval`: a sampled first guess kept at these temperatures


def proposer_vocab(greedy: bool, chosen: int | None = None) -> int:
    """The user's --proposer-vocab if given, else the default for the mode."""
    return PROPOSER_VOCAB["greedy" if greedy else "sample"] if chosen is None else chosen


# The batch engine: positions a page of the shared pool holds (every cache of a sequence uses the
# same page table), and tokens a prefill pass takes when several requests join (a long prompt goes alone).
PAGE_SIZE = 16
PREFILL_TOKENS = 1024
# A greedy request's k cap under load (its k not given), per kind of proposer: (batch size up to, k
# cap). A pass over the batch costs more as it grows, so a guess kept less often stops paying first
# (docs/benchmarks.md, "The batch engine").
LOAD_K = {"draft": ((4, MAX_K), (1 << 30, 2)), "mtp": ((1 << 30, MAX_K),)}


def load_cap(proposer: str, batch: int) -> int:
    """The most guesses per round a greedy sequence gets among `batch` (`LOAD_K`): the MTP module's
    policy for a name holding "mtp", none for the n-gram lookup alone, a draft's otherwise."""
    if proposer == NGRAM:
        return MAX_K
    for size, cap in LOAD_K["mtp" if "mtp" in proposer else "draft"]:
        if batch <= size:
            return cap
    return MAX_K


# `smallem data --continuations`: contexts as long as a bench prompt, continued to fill a training
# window of 256 tokens; one in three sampled at T = 1 (sampled requests meet sampled text).
GEN_CONTEXT = 32
GEN_NEW = 224
GEN_SAMPLED_EVERY = 3
GEN_BATCH = 32  # sequences decoded together (the batch engine, target alone)
# The repetition penalty's range (1 is off): beyond it a float32 logit divided by it, then by the
# temperature, could overflow to infinity (1e-38 made every token the last id) or a row vanish.
MIN_PENALTY = 1e-3
MAX_PENALTY = 1e3
MAX_PROMPTS_BYTES = 64 << 20  # `bench --prompts`: the most bytes read (/dev/zero never ends)
