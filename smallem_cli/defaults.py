"""Every default of the command line, declared once."""

from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
DATA_DIR = Path("data")
TOKENIZER = CHECKPOINTS / "tokenizer.json"
TARGET = CHECKPOINTS / "target.safetensors"
MTP = CHECKPOINTS / "mtp.safetensors"
PROMPTS = Path(__file__).resolve().parent.parent / "prompts" / "kjv-val-32.jsonl"
BATCH_PROMPTS = PROMPTS.with_name("kjv-val-32x64.jsonl")  # `bench --batch`: 64 held-out prompts of 32 tokens

# The proposer per mode: greedy text repeats itself, so the n-gram lookup drafts it for free (docs/benchmarks.md).
PROPOSER = {"greedy": "ngram+mtp", "sample": "mtp"}
# `bench`'s rows beside the target alone when no --proposers are named: the shipped ones beside a smallem
# checkpoint (an HF folder or a GGUF file ships none: `family.bench_proposers`).
BENCH_PROPOSERS = ("draft-2l", "draft-4l", "mtp")
BENCH_PROPOSERS_HELP = (
    f"comma-separated proposers (default: those of {','.join(BENCH_PROPOSERS)} beside a smallem checkpoint; for an HF "
    "folder or a GGUF file: ngram, any MTP module for it found beside it, and its EAGLE head)"
)
PROPOSER_HELP = (
    f"none|ngram|suffix|draft-2l|draft-4l|mtp|eagle|PATH|ngram+P|suffix+P (default: {PROPOSER['greedy']} greedy, "
    f"{PROPOSER['sample']} sampled; HF: none)"
)
# Default k per proposer, (greedy, sampled): the best of `bench --sweep-k` (docs/benchmarks.md, "The default k").
K = {"draft-2l": (4, 3), "draft-4l": (4, 2), "mtp": (4, 3), "ngram": (4, 4), "suffix": (32, 8), "eagle": (8, 8)}
K_OTHER = 3  # a proposer given by path
# The n-gram lookup: the last NGRAM_MAX..NGRAM_MIN tokens, longest first (a 1-gram drafts badly).
NGRAM = "ngram"
NGRAM_MIN = 2
NGRAM_MAX = 4
NGRAM_DRAFT_COST = 0.16  # one more token's cost in a verify pass, in one-token passes (docs/benchmarks.md)
# The suffix lookup (`spec.suffix`): the n-gram lookup, and the texts this process wrote before, at most SUFFIX_TOKENS
# of them (the oldest evicted first; about a hundred bytes of index a token).
SUFFIX = "suffix"
SUFFIX_TOKENS = 1 << 18
LOOKUPS = (NGRAM, SUFFIX)
# An EAGLE head (`--proposer eagle`: the one in checkpoints/ or beside the target made for its weights): its chain
# stops at a draft token it gives less than EAGLE_MIN_TOP (EAGLE-2: the head's confidence tracks acceptance).
EAGLE = "eagle"
EAGLE_MIN_TOP = 0.5
# its default k: the best by the cost model (`engine.cost`) up to MAX_EAGLE_K on the native engine, else K's
MAX_EAGLE_K = 8
# `train eagle`: its data (answers of at most EAGLE_ANSWER tokens), its head's vocabulary, its training windows
EAGLE_DATA_TOKENS = 400_000
EAGLE_ANSWER = 256
EAGLE_VOCAB = 8192
EAGLE_SEQ = 256  # the model-free proposers, alone or before a model's (`ngram+P`, `suffix+P`)
# Token trees (`--tree N`, MTP only; 0: the chain): N draft tokens from each node's and level's TREE_WIDTH best;
# a sampled request's nodes get TREE_DRAWS children drawn from q (SpecInfer's rule).
TREE = 0
TREE_WIDTH = 4
TREE_DRAWS = 2
TREE_HELP = "token trees of N draft tokens per round, k levels deep (MTP only; 0 = a chain)"
MAX_TREE = 64


def default_k(proposer: str, greedy: bool, k: int | None = None) -> int:
    """The user's k, else the proposer's default (`ngram+P`, `suffix+P` and `P@tree12` as P); `none` proposes nothing
    (0)."""
    if proposer == "none":
        return 0
    if k is not None:
        return k
    name = next((proposer.removeprefix(f"{x}+") for x in LOOKUPS if proposer.startswith(f"{x}+")), proposer)
    name = name.split("@")[0]
    return K[name][0 if greedy else 1] if name in K else K_OTHER


MAX_K = 64
MIN_TEMPERATURE = 1e-3  # below it, logits / temperature overflow float32 (0 is greedy)
MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes
MAX_NEW_TOKENS = 200
BENCH_REPEATS = 3  # `bench`: timed runs per configuration (the median is reported)
BENCH_TEMPERATURE = 1.0
# `train`: the defaults of every member's training (`train.TrainSettings`)
TRAIN_SECONDS = 600.0
TRAIN_BATCH = 16
TRAIN_SEQ_LEN = 256
TRAIN_LR = 2e-3
TRAIN_SEED = 1234
TRAIN_MTP_WEIGHT = 0.3  # `train target`: its MTP module's loss weight (DeepSeek-V3's lambda)
TRAIN_COMPILE = False  # `train --compile` and `--precision bf16`: off unless asked (docs/family.md)
TRAIN_PRECISION = "fp32"
TEMPERATURE = 0.0
SEED = 0
DEVICE = "auto"
MAX_BATCH = 16  # `smallem batch`: requests decoded together, at most
SERVE_HOST, SERVE_PORT = "127.0.0.1", 8000  # `smallem serve`: reached from this machine alone unless told
SERVE_QUEUE = 256  # requests waiting for a place in the batch, at most: more are answered 429
SERVE_DRAIN = 30  # seconds SIGTERM waits for the answers in flight before cancelling them
SERVE_STREAM_RATE = 400.0  # server-sent events a second, shared by the requests in flight (`serve.worker.Worker`)
# `smallem serve`'s guard on its connections (`serve.guard`): open at once, at most (kept under the file limit);
# seconds a request's line and headers, then its body, may take to arrive; the listen backlog (sockets accepted
# in one round before any is counted: they too must stay under the file limit).
SERVE_MAX_CONNECTIONS = 512
CONNECTIONS_HELP = (
    f"connections open at once, at most; more are refused at once (default: {SERVE_MAX_CONNECTIONS}, or what the file "
    "limit allows)"
)
SERVE_HEADER_TIMEOUT = 10.0
SERVE_BODY_TIMEOUT = 60.0
SERVE_BACKLOG = 128
# `smallem batch`: a request line's bytes at most, never read whole past it (a 50 MB line took 10 GB to
# tokenize); a target of a longer context gets LINE_BYTES_PER_TOKEN a position (`\u00e9` is 6 bytes).
MAX_LINE_BYTES = 1 << 20
LINE_BYTES_PER_TOKEN = 64
CACHE_MEMORY_SHARE = 0.5  # the batch engine's K/V cache: at most this share of the free memory
# Decode steps: "native" (C++), "native-avx2", "eager" (PyTorch); "auto": $SMALLEM_ENGINE, else native on a CPU.
ENGINE = "auto"
# A proposer's head keeps this many most frequent tokens (0: all); a sampled draft token needs more of q's mass.
PROPOSER_VOCAB = {"greedy": 1024, "sample": 2048}
# How the native engine stores a proposer's matrices: "int8" (half the bytes, about the same acceptance)
# or "f16"; the target's are always its own (docs/benchmarks.md).
PROPOSER_WEIGHTS = "int8"
WEIGHTS = ("int8", "f16")
WEIGHTS_HELP = f"int8 | f16: how the native engine stores the proposer's matrices (default: {PROPOSER_WEIGHTS})"
EVAL_TEMPERATURES = (1.0, 0.7)  # `smallem eval`: a sampled first draft token accepted at these temperatures


def proposer_vocab(greedy: bool, chosen: int | None = None) -> int:
    """The user's --proposer-vocab if given, else the default for the mode."""
    return PROPOSER_VOCAB["greedy" if greedy else "sample"] if chosen is None else chosen


# The batch engine: positions a page of the pool holds, and tokens a prefill pass takes when requests join.
PAGE_SIZE = 16
PREFILL_TOKENS = 1024
# Greedy requests get draft tokens (a model proposer's) only while at most this many sequences run: the native batch
# pass's cost grows far slower than its rows, so a row of another sequence buys more than a draft token's row (the
# measurements: docs/benchmarks.md, "2026-12-05, fifth session").
SPECULATE_UP_TO = 2


def load_cap(proposer: str, batch: int) -> int:
    """The most draft tokens per round a greedy sequence gets among `batch`: no cap for the n-gram lookup alone."""
    return MAX_K if proposer in LOOKUPS or batch <= SPECULATE_UP_TO else 0


# `smallem data --continuations`: bench-prompt-long contexts continued to a 256-token window; one in 3 sampled.
GEN_CONTEXT = 32
GEN_NEW = 224
GEN_SAMPLED_EVERY = 3
GEN_BATCH = 32  # sequences decoded together (the batch engine, target alone)
# The repetition penalty's range (1 is off): beyond it a float32 logit could overflow or a row vanish.
MIN_PENALTY = 1e-3
MAX_PENALTY = 1e3
MAX_PROMPTS_BYTES = 64 << 20  # `bench --prompts`: the most bytes read (/dev/zero never ends)
