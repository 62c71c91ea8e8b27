"""Finding and loading a target (a smallem checkpoint, an HF Llama folder, a GGUF file) and its proposer (`none`,
`ngram`, a shipped name, a path, or `ngram+P`). A proposer whose tokenizer differs is refused before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .. import defaults
from ..defaults import LOOKUPS, NGRAM
from ..interop import gguf, hf
from ..model import checkpoint, eagle
from ..model.chat import ChatFormat, check_template, hf_format, hf_template, own_format
from ..model.checkpoint import CheckpointError
from ..model.llama import MTPModule, Transformer
from ..model.tokenizer import load_tokenizer
from ..spec.head import Head

SHIPPED_PROPOSERS = ("none", "draft-2l", "draft-4l", "mtp")


@dataclass
class Target:
    model: Transformer
    tokenizer: Path | None  # its tokenizer.json; None for a GGUF file, whose tokenizer is inside
    fingerprint: str  # of its vocabulary (`checkpoint.vocab_fingerprint`): a proposer's must be equal
    path: Path
    tok: Tokenizer  # the tokenizer, loaded: what callers encode and decode with
    hf: bool = False  # a Hugging Face folder, not a smallem checkpoint
    chat: ChatFormat = field(default_factory=ChatFormat)  # the tokens that end its turn, its chat template
    gguf: tuple[str, ...] = ()  # a GGUF file: the tensor types it holds (e.g. ("F32", "Q8_0"))

    @property
    def ships_none(self) -> bool:  # an HF folder or a GGUF file: no shipped proposer lies beside it
        return self.hf or bool(self.gguf)


def foreign(path: Path) -> bool:
    """An HF folder or a GGUF file: a model Smallem did not train, its tokenizer its own."""
    return hf.is_hf_dir(path) or gguf.is_gguf(path)


def default_proposer(target: Path, greedy: bool) -> str:
    """The proposer used when none is named: none for an HF folder or a GGUF file (they ship none)."""
    return "none" if foreign(target) else defaults.PROPOSER["greedy" if greedy else "sample"]


def bench_proposers(target: Target) -> list[str]:
    """`bench`'s proposers when none are named: the shipped ones beside a smallem checkpoint (else the n-gram lookup);
    for an HF folder or a GGUF file, the n-gram lookup, each `*mtp*.safetensors` beside it made for this target, and
    the EAGLE head made for its weights if there is one."""
    if not target.ships_none:
        found = [n for n in defaults.BENCH_PROPOSERS if proposer_path(n, target.path.parent).is_file()]
        return found or [NGRAM]
    folder = target.path if target.hf else target.path.parent
    mtps = [str(p) for p in sorted(folder.glob("*mtp*.safetensors")) if _module_for(p, target)]
    try:
        heads = [defaults.EAGLE] if find_eagle(target) else []
    except CheckpointError:
        heads = []
    return [NGRAM, *mtps, *heads]


def _module_for(path: Path, target: Target) -> bool:
    try:
        meta = checkpoint.read_meta(path)
        cfg = checkpoint.config_of(meta, path)
    except (CheckpointError, OSError, ValueError):
        return False
    mine = target.model.cfg
    same = (cfg.dim, cfg.vocab_size, cfg.n_heads) == (mine.dim, mine.vocab_size, mine.n_heads)
    return meta.get("kind") == "mtp" and meta.get("tokenizer") == target.fingerprint and same


def load_target(path: Path, device: torch.device, tokenizer: Path | None = None, chat: bool = False) -> Target:
    """The target at `path`; with `chat`, a broken chat template fails (ChatError) before the weights load."""
    if gguf.is_gguf(path):
        if tokenizer is not None:
            raise CheckpointError(f"--tokenizer: the GGUF file {path} holds its own tokenizer; leave it out")
        got = gguf.load_gguf(path, device, check_chat=chat)
        return Target(got.model.pack(), None, got.fingerprint, path, got.tokenizer, chat=got.chat, gguf=got.types)
    is_hf = hf.is_hf_dir(path)
    if is_hf:
        if chat:
            check_template(hf_template(path), str(path))
        model, fp = hf.load_hf(path, device)
        tok_path = tokenizer or path / "tokenizer.json"
    else:
        model, meta = checkpoint.load_model(path, device)
        tok_path = tokenizer or path.parent / "tokenizer.json"
        if not tok_path.is_file():
            raise CheckpointError(f"tokenizer not found: {tok_path}")
        fp = checkpoint.tokenizer_fingerprint(tok_path)
        if meta.get("tokenizer") and meta["tokenizer"] != fp:
            raise CheckpointError(f"{path} was trained with another tokenizer than {tok_path}")
    tok = load_tokenizer(tok_path)
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= model.cfg.vocab_size:  # an id past the embedding would fail in the middle of a run
        raise CheckpointError(f"{tok_path}: token id {top} does not fit {path}'s vocabulary of {model.cfg.vocab_size}")
    turns = hf_format(path, tok, model.cfg.vocab_size) if is_hf else own_format(tok)
    return Target(model.pack(), tok_path, fp, path, tok, is_hf, turns)


@dataclass
class LoadedProposer:
    """A proposer as loaded (`build.proposer_for` makes it the engine's): the n-gram lookup, a model, both, or none."""

    name: str
    model: Transformer | MTPModule | None = None
    head: Head | None = None
    lookup: str = ""  # the model-free one before it, or alone: ngram or suffix ("": none)
    tree: tuple[int, int] | None = None  # (draft tokens, width): the MTP module grows token trees
    int8: bool = False  # the native backend reads the model's matrices as int8
    spec: str = ""  # what it was loaded as, which picks its default k (`defaults.default_k`); "": its name
    # an EAGLE head's measured acceptance at each draft position (its facts): its default k, by the cost model
    acceptance: tuple[float, ...] = ()
    measured_k: int | None = None  # its k by the cost model, once measured (`build.measured_k`)

    @property
    def models(self) -> list[Transformer | MTPModule]:
        return [] if self.model is None else [self.model]

    def default_k(self, greedy: bool) -> int:
        return defaults.default_k(self.spec or self.name, greedy)


NONE = LoadedProposer("none")


def proposer_path(spec: str, target_dir: Path) -> Path:
    """A shipped proposer's name -> its file beside the target; anything else is a path."""
    return target_dir / f"{spec}.safetensors" if spec in SHIPPED_PROPOSERS else Path(spec)


def _proposer_path(spec: str, target: Target) -> Path:
    if spec in SHIPPED_PROPOSERS and target.ships_none:
        kind = "GGUF" if target.gguf else "Hugging Face"
        raise CheckpointError(
            f"proposer {spec!r} is a shipped name, looked up beside a smallem checkpoint; "
            f"the {kind} target {target.path} ships none: give the proposer's path, or none"
        )
    return proposer_path(spec, target.path.parent)


def load_proposer(
    spec: str, target: Target, device: torch.device, vocab: int = 0, tree: tuple[int, int] | None = None,
    weights: str = defaults.PROPOSER_WEIGHTS,
) -> LoadedProposer:  # fmt: skip
    """`spec` -> the proposer it names, packed; vocab > 0 cuts its head to the most frequent training tokens."""
    if weights not in defaults.WEIGHTS:
        raise CheckpointError(f"--proposer-weights takes {' or '.join(defaults.WEIGHTS)}, got {weights!r}")
    if tree is not None and not _is_mtp(spec, target):
        raise CheckpointError(f"--tree needs the MTP module as proposer, not {spec!r}")
    if spec == "none":
        return NONE
    if spec in LOOKUPS:
        return LoadedProposer(spec, lookup=spec)
    if (lookup := next((x for x in LOOKUPS if spec.startswith(x + "+")), None)) is not None:
        rest = spec.removeprefix(lookup + "+")
        if rest == "none" or rest in LOOKUPS or any(rest.startswith(x + "+") for x in LOOKUPS):
            raise CheckpointError(f"proposer {spec!r}: {lookup}+ takes a model proposer (a draft or an MTP module)")
        other = load_proposer(rest, target, device, vocab, weights=weights)
        return LoadedProposer(
            f"{lookup}+{other.name}", other.model, other.head, lookup=lookup, int8=other.int8, spec=spec,
            acceptance=other.acceptance,
        )  # fmt: skip
    path = find_eagle(target) if spec == defaults.EAGLE else _proposer_path(spec, target)
    name = path.stem or str(path)
    int8 = weights == "int8"
    if foreign(path):  # a draft model of the target's family, as llama.cpp's -md: an HF folder or a GGUF file
        draft, fp = hf.load_hf(path, device) if hf.is_hf_dir(path) else _gguf_model(path, device)
        _same_vocab(target, fp, draft.cfg.vocab_size, path)
        _fits(target, draft, path)
        return LoadedProposer(name, draft.pack(), Head(draft), int8=int8, spec=spec)
    meta = checkpoint.read_meta(path)  # the tensors load once, below
    if meta.get("kind") == eagle.KIND:
        head, _ = eagle.load(path, target.model, device)
        _same_vocab(target, meta.get("tokenizer", ""), head.cfg.vocab_size, path)
        got = eagle.acceptance(checkpoint.facts(meta))
        return LoadedProposer(defaults.EAGLE, head.pack(), Head(head, head.ids), int8=int8, acceptance=got)
    vocab_size = checkpoint.config_of(meta, path).vocab_size
    _same_vocab(target, meta.get("tokenizer", ""), vocab_size, path)
    rank = checkpoint.vocab_rank(meta, path, vocab_size)
    ids = torch.tensor(rank[:vocab], device=device) if vocab and rank else None
    if meta.get("kind") == "mtp":
        mtp, _ = checkpoint.load_mtp(path, target.model, device)
        return LoadedProposer("mtp", mtp.pack(), Head(target.model, ids), tree=tree, int8=int8, spec=spec)
    draft, _ = checkpoint.load_model(path, device)
    _fits(target, draft, path)
    return LoadedProposer(name, draft.pack(), Head(draft, ids), int8=int8, spec=spec)


def find_eagle(target: Target) -> Path:
    """The EAGLE head made for `target`'s weights (`eagle.weights_fingerprint`), in the install's checkpoints/ or
    beside the target, whatever the target's file is called."""
    fp = eagle.weights_fingerprint(target.model)
    folder = target.path if target.hf else target.path.parent
    for path in [*sorted(defaults.CHECKPOINTS.glob("*.safetensors")), *sorted(folder.glob("*.safetensors"))]:
        try:
            meta = checkpoint.read_meta(path)
        except (CheckpointError, OSError):
            continue
        if meta.get("kind") == eagle.KIND and meta.get("target") == fp:
            return path
    raise CheckpointError(
        f"no EAGLE head for {target.path} (weights {fp}) in {defaults.CHECKPOINTS} or beside it: "
        "make one with `smallem train eagle`, or give its path"
    )


def _is_mtp(spec: str, target: Target) -> bool:
    """Whether `spec` names an MTP module's checkpoint (read from its header alone)."""
    if spec in ("none", defaults.EAGLE) or spec in LOOKUPS or any(spec.startswith(x + "+") for x in LOOKUPS):
        return False
    path = _proposer_path(spec, target)
    return not foreign(path) and checkpoint.read_meta(path).get("kind") == "mtp"


def _gguf_model(path: Path, device: torch.device) -> tuple[Transformer, str]:
    got = gguf.load_gguf(path, device)
    return got.model, got.fingerprint


def _fits(target: Target, draft: Transformer, path: Path) -> None:
    if draft.cfg.max_seq_len < target.model.cfg.max_seq_len:
        raise CheckpointError(
            f"proposer {path} has a context of {draft.cfg.max_seq_len} tokens, "
            f"shorter than the target's {target.model.cfg.max_seq_len}"
        )


def _same_vocab(target: Target, fingerprint: str, vocab_size: int, path: Path) -> None:
    if vocab_size != target.model.cfg.vocab_size or (fingerprint and fingerprint != target.fingerprint):
        raise CheckpointError(
            f"proposer {path} does not share the target's tokenizer "
            f"(vocabulary {vocab_size} vs {target.model.cfg.vocab_size}, fingerprint {fingerprint or '?'} "
            f"vs {target.fingerprint})"
        )


def pick_device(name: str) -> torch.device:
    """auto | cpu | cuda | cuda:N -> a device that exists, or ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}: use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("CUDA was asked for, but this machine has no usable CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"no such CUDA device: {name} ({torch.cuda.device_count()} present)")
    return dev
