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

# The proposer used when none is named, per mode: greedy, the n-gram lookup backed by the MTP
# module (greedy text repeats itself, and a lookup guesses it for free); sampled, the MTP module
# (sampled text rarely repeats). Measured: docs/benchmarks.md, "The n-gram proposer".
PROPOSER = {"greedy": "ngram+mtp", "sample": "mtp"}
# What --proposer takes, and its default per mode, as the help of generate and batch says it.
PROPOSER_HELP = (
    f"none|ngram|draft-2l|draft-4l|mtp|PATH|ngram+P [default: {PROPOSER['greedy']} greedy, "
    f"{PROPOSER['sample']} sampled; HF: none]"
)
# Default k per proposer, (greedy, sampled): the best of `smallem bench --sweep-k` on the shipped
# family, on the native engine (docs/benchmarks.md, "The default k"). Read through `default_k`.
K = {"draft-2l": (4, 3), "draft-4l": (4, 2), "mtp": (4, 3), "ngram": (4, 4)}
K_OTHER = 3  # a proposer given by path
# The model-free proposer (prompt lookup): the last NGRAM_MAX..NGRAM_MIN tokens looked up in
# the text so far, longest first. A 1-gram matches almost always and guesses badly.
NGRAM = "ngram"
NGRAM_MIN = 2
NGRAM_MAX = 4
# What one more token adds to a verify pass, in one-token passes: the n-gram lookup weighs it
# against its measured acceptance to choose how many guesses to offer (`bench --costs` reads v;
# docs/benchmarks.md, "Pass costs").
NGRAM_GUESS_COST = 0.16
# Adaptive depth (--draft-p-min): 0 keeps every round at k guesses.
P_MIN = 0.0
# Token trees (`--tree N`, MTP only): N guesses per tree, grown from each node's TREE_WIDTH best
# tokens and the TREE_WIDTH best nodes of each level (`engine.tree_guess`); 0 keeps the chain.
TREE = 0
TREE_WIDTH = 4
# A sampled request's tree: each expanded node gets TREE_DRAWS children drawn from the module's
# q (SpecInfer's rule verifies them); fewer children per node leave room for more depth.
TREE_DRAWS = 2
TREE_HELP = "token trees of N guesses per round, k levels deep (MTP only; 0 = a chain)"
MAX_TREE = 64


def default_k(proposer: str, greedy: bool, k: int | None = None) -> int:
    """The guesses per round: the user's k where given, else the proposer's default for the mode
    (`K`); `none` proposes nothing (0, whatever k). `ngram+P` guesses as deep as P does, and P at
    adaptive depth (bench's `P@p0.4`) too."""
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
# `train target`: the weight of its MTP module's loss in their joint training (DeepSeek-V3's lambda,
# which it set to 0.3 for most of its run)
TRAIN_MTP_WEIGHT = 0.3
# `train --compile`: the loss (forward and backward) through torch.compile's inductor, compiled
# once a run (about 30 s cold for the target's). Off by default: the Makefile's recipe asks for it.
TRAIN_COMPILE = False
# `train --precision`: "fp32", or "bf16" (the loss's matrix products in bfloat16 under autocast, the
# weights, the optimiser and every loss in float32). Measured faster on an AMD Zen 4 host
# (AVX512_BF16; docs/family.md, "`smallem train --precision bf16`"); the Makefile's recipe asks for it.
TRAIN_PRECISION = "fp32"
TEMPERATURE = 0.0
SEED = 0
DEVICE = "auto"
# `smallem batch`: at most this many requests decoded together (more wait for a free place).
MAX_BATCH = 16
# `smallem batch`: a request line's bytes before its `\n`, at most (`batch_io.max_line_bytes`). A longer
# line is answered with an error, never read whole nor tokenized: a 50 MB line took 10 GB in the
# tokenizer to be refused for its length. 1 MiB is some 250,000 tokens of English text, far past the
# shipped context (1,024 tokens); a target of a longer context gets LINE_BYTES_PER_TOKEN bytes a
# position of it (a JSON escape such as \u00e9 writes one character in 6 bytes, a token holds several).
MAX_LINE_BYTES = 1 << 20
LINE_BYTES_PER_TOKEN = 64
# The batch engine's K/V cache (`engine.build.cache_budget`) takes at most this share of the memory
# free when it is built (the GPU's, or the machine's for a CPU); the rest is left to the passes'
# activations. A --max-batch whose sequences would not fit at the full context is lowered to what fits
# (`bench --batch` refuses it: a row runs at the size it names).
CACHE_MEMORY_SHARE = 0.5
# Decode steps (`engines`): "native" (C++ over the float16 weights, `native/`, built for AVX-512
# where the CPU has it), "native-avx2" (its AVX2 build, to compare), "eager" (PyTorch: the
# reference, and the GPU's); "auto": $SMALLEM_ENGINE where it is set, else native on a CPU and
# eager elsewhere.
ENGINE = "auto"
# `bench --costs` reads v for passes over these many tokens (verify passes, catch-ups, batches).
COST_PASSES = (1, 2, 3, 4, 5, 8, 16)
# A proposer's head keeps the rows of this many most frequent tokens (0: all of them), greedy
# and sampled: a greedy guess outside the top 1,024 is rare, but a sampled guess is drawn from
# q, and q's mass outside the cut is p's mass that no guess can take (measured by `smallem bench`).
PROPOSER_VOCAB = {"greedy": 1024, "sample": 2048}


# How the native engine stores a proposer's matrices (`--proposer-weights`): "int8" (per-row
# scales, `native.panels8`: half the bytes a guess reads, for about the same acceptance) or
# "f16", its checkpoint's values (`bench --proposer-weights int8,f16`; docs/benchmarks.md, "A
# proposer's matrices as int8"). The target's are always its own values: the text is the target's.
PROPOSER_WEIGHTS = "int8"
WEIGHTS = ("int8", "f16")
WEIGHTS_HELP = f"int8 | f16: how the native engine stores the proposer's matrices [default: {PROPOSER_WEIGHTS}]"

# `smallem eval` reads how often a sampled first guess is kept at these temperatures.
EVAL_TEMPERATURES = (1.0, 0.7)


def proposer_vocab(greedy: bool, chosen: int | None = None) -> int:
    """The user's --proposer-vocab if given, else the default for the mode."""
    return PROPOSER_VOCAB["greedy" if greedy else "sample"] if chosen is None else chosen


# The batch engine (`smallem batch`, `bench --batch`). Pages of the shared pool hold this many
# positions (each cache of a sequence, target's and proposer's, uses the same page table).
PAGE_SIZE = 16
# Tokens per prefill pass when several requests join at once (a long prompt goes alone).
PREFILL_TOKENS = 1024
# Guesses per round under load, for greedy requests whose k was not given: per kind of proposer,
# (batch size up to, k cap). A pass over the whole batch costs more as the batch grows, so a
# guess kept less often stops paying first: a draft drops to 2 guesses past 4 sequences, MTP
# keeps its k (`bench --batch 1,4,16,64 -k 1,2,4`; docs/benchmarks.md, "The batch engine").
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


# `smallem data --continuations`: the target's own text for its proposers (`continuations.py`).
# A context as long as a bench prompt, a continuation to fill a training window of 256 tokens;
# one context in three sampled at T = 1 (sampled requests meet sampled text), the rest greedy.
GEN_CONTEXT = 32
GEN_NEW = 224
GEN_SAMPLED_EVERY = 3
GEN_BATCH = 32  # sequences decoded together (the batch engine, target alone)

# The repetition penalty's accepted range: a logit is divided by it (or multiplied), then by the
# temperature, so beyond these a float32 logit of the model's size could overflow to infinity
# (1e-38 made every token the last id) or a whole row vanish to -inf; 1 is off.
MIN_PENALTY = 1e-3
MAX_PENALTY = 1e3
# `bench --prompts`: the most bytes read from the file (a device such as /dev/zero never ends).
MAX_PROMPTS_BYTES = 64 << 20
