"""A random-weight Llama as llama.cpp and Hugging Face read it: test and benchmark fixtures of a real model's shape
whose weights nobody has to download.

Builds, in --out (each output skipped where it exists, each written aside and then renamed):
  hf/           a Hugging Face float16 folder (transformers' own save_pretrained), SmolLM2's tokenizer;
  f16.gguf      converted from hf/ by llama.cpp's own convert_hf_to_gguf.py (from llama-cpp-python's sdist);
  q8_0.gguf     } quantized from f16.gguf by llama.cpp (llama_model_quantize)
  q4_k_m.gguf   }
then loads each GGUF file in llama.cpp and decodes a few tokens greedily.

  .venv/bin/python scripts/llama_fixture.py --shape 1b --out models/llama-1b   (`make llama-1b`)
  .venv/bin/python scripts/llama_fixture.py --shape tiny --out models/llama-tiny   (`make llama-tiny`: quick)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from smallem_cli import atomic


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    # The projections' std. At 0.02 a 2-layer model's blocks add too little to the residual beside the (tied)
    # embedding: greedy decoding then repeats one token; 0.06 gives a text of distinct tokens. 24 layers at
    # 0.02 already do.
    proj_std: float = 0.02


# `1b`: SmolLM2-1.7B's shape; `tiny`: the same recipe in seconds
SHAPES = {
    "1b": Shape(hidden=2048, layers=24, heads=32, kv_heads=32, intermediate=8192),
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, proj_std=0.06),
}
QUANTS = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
CONVERTER = "vendor/llama.cpp"  # within the sdist: the converter, its `conversion` package and its gguf-py
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
PROMPT = "And God said"
CHECK_TOKENS = 8
AMX_HINT = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 in C and C++ flags: the Makefile's LLAMACPP_CMAKE"
MIN_DISTINCT = 3  # of CHECK_TOKENS greedy tokens: fewer, and the fixture is too degenerate to show anything


class FixtureError(Exception):
    """A step failed; its message says which and why."""


def log(msg: str) -> None:
    print(msg, flush=True)


def step(name: str, out: Path, build: Callable[[], None]) -> None:
    """Run `build` unless `out` exists; say how long it took."""
    if out.exists():
        log(f"{name}: {out} exists, skipped")
        return
    t0 = time.monotonic()
    build()
    log(f"{name}: {out} in {time.monotonic() - t0:.1f} s")


def build_folder(out: Path, fill: Callable[[Path], None]) -> None:
    """fill(tmp) a folder beside `out`, then rename it to `out`: a folder there is always whole."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def clear_leftovers(folder: Path, pattern: str = ".*.tmp") -> None:
    """The temporaries of an interrupted run (`.NAME.PID.tmp`): never read, so removed."""
    for p in folder.glob(pattern):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def write_tokenizer(folder: Path, gguf_file: Path) -> tuple[int, int, int]:
    """SmolLM2's tokenizer (from the SmolLM2 GGUF file, as smallem reads it) as tokenizer.json and
    tokenizer_config.json; its (vocabulary size, BOS id, EOS id)."""
    from smallem_cli.interop.gguf import load_gguf

    g = load_gguf(gguf_file)
    tok, chat = g.tokenizer, g.chat
    tok.save(str(folder / "tokenizer.json"))
    bos, eos = tok.token_to_id(chat.bos), tok.token_to_id(chat.eos)
    if bos is None or eos is None:
        raise FixtureError(f"{gguf_file}: its BOS {chat.bos!r} or EOS {chat.eos!r} is not a token")
    config = {
        # Not GPT2Tokenizer (SmolLM2's own class): transformers 5 builds that one's pre-tokenizer itself and drops
        # the Digits split of tokenizer.json. PreTrainedTokenizerFast takes tokenizer.json as it is, so llama.cpp's
        # converter, hashing how it splits its test text, recognises the split as SmolLM's ("smollm").
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": chat.bos,
        "eos_token": chat.eos,
        "pad_token": chat.eos,
        "unk_token": tok.id_to_token(0),
        "add_bos_token": False,  # SmolLM2 adds none: its chat template starts each turn itself
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": chat.template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return tok.get_vocab_size(), bos, eos


def write_hf(folder: Path, shape: Shape, tokenizer_gguf: Path, seed: int) -> None:
    import torch  # here: the checks' processes (--decode) need none of it
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, bos, eos = write_tokenizer(folder, tokenizer_gguf)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        tie_word_embeddings=True,
        rope_theta=130000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # normal(0, initializer_range) weights, from the seeded generator
    if shape.proj_std != config.initializer_range:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.weight"):
                    p.mul_(shape.proj_std / config.initializer_range)
    model = model.half()
    model.save_pretrained(folder)
    del model


def llama_cpp_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise FixtureError('llama-cpp-python is not installed: .venv/bin/pip install -e ".[llamacpp]"') from None


def fetch_converter(folder: Path, version: str) -> None:
    """llama.cpp's converter, as the installed llama-cpp-python vendors it: its sdist, downloaded by pip, unpacked
    (the converter's parts alone)."""
    dl = folder / "sdist"
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
           f"llama-cpp-python=={version}", "-d", str(dl)]  # fmt: skip
    if subprocess.run(cmd).returncode != 0:
        raise FixtureError(f"pip could not download the llama-cpp-python {version} sdist")
    (sdist,) = dl.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        prefix = f"{root}/{CONVERTER}/"
        members = []
        for m in tar.getmembers():
            rel = m.name[len(prefix) :] if m.name.startswith(prefix) else ""
            if rel and rel.startswith(CONVERTER_PARTS):
                m.name = rel
                members.append(m)
        tar.extractall(folder, members=members, filter="data")
    shutil.rmtree(dl)
    if not (folder / CONVERTER_PARTS[0]).is_file():
        raise FixtureError(f"{sdist.name} holds no {CONVERTER}/{CONVERTER_PARTS[0]}")


def convert(hf: Path, converter: Path, out: Path, name: str) -> None:
    cmd = [sys.executable, str(converter / CONVERTER_PARTS[0]), str(hf), "--outtype", "f16", "--outfile", str(out),
           "--model-name", name]  # fmt: skip
    if subprocess.run(cmd).returncode != 0:
        raise FixtureError(f"llama.cpp's converter failed on {hf}")
    pre = gguf_text(out, "tokenizer.ggml.pre")
    if pre != "smollm":  # the converter names the split it recognised: another is another tokenizer
        raise FixtureError(f"{out}: tokenizer.ggml.pre is {pre!r}, not 'smollm'")


def gguf_text(path: Path, key: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get(key)
    return None if field is None else str(field.contents())


def quantize(src: Path, out: Path, ftype_name: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise FixtureError(f"llama.cpp could not quantize {src} as {ftype_name}")


def decode(path: Path) -> list[int]:
    """Load `path` in llama.cpp and decode CHECK_TOKENS tokens greedily."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False)
    tokens: list[int] = []
    steps = llm.generate(llm.tokenize(PROMPT.encode(), add_bos=False), top_k=1, temp=0.0)
    try:
        while len(tokens) < CHECK_TOKENS:
            tokens.append(next(steps))
    finally:
        steps.close()
        llm.close()
    return tokens


def check(path: Path) -> list[int]:
    """decode(path) in a process of its own, as llama.cpp dies on a signal where its build does not fit the CPU
    (one with AMX in a VM that does not allow it: SIGILL or SIGSEGV); FixtureError if the tokens are too alike."""
    run = subprocess.run([sys.executable, __file__, "--decode", str(path)], capture_output=True, text=True)
    if run.returncode < 0:
        raise FixtureError(f"llama.cpp died of {signal.Signals(-run.returncode).name} decoding {path}: on a CPU with "
                           f"AMX, rebuild llama-cpp-python without it ({AMX_HINT})")  # fmt: skip
    if run.returncode != 0:
        raise FixtureError(f"llama.cpp could not decode {path}: {run.stderr.strip()[-300:]}")
    tokens = json.loads(run.stdout.splitlines()[-1])
    if len(set(tokens)) < MIN_DISTINCT:
        raise FixtureError(f"{path}: greedy tokens {tokens} are too degenerate (< {MIN_DISTINCT} distinct)")
    return tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="the fixture's folder (required)")
    ap.add_argument("--shape", choices=SHAPES, default="1b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", type=Path, default=Path("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
                    help="SmolLM2's GGUF file, whose tokenizer the fixture takes (`make smollm2`)")  # fmt: skip
    ap.add_argument("--converter", type=Path, help="where llama.cpp's converter is unpacked "
                    "(default: .llama-cpp-python-VERSION beside --out, shared by the fixtures)")  # fmt: skip
    ap.add_argument("--decode", type=Path, help=argparse.SUPPRESS)  # check()'s child: decode(FILE), JSON out
    args = ap.parse_args(argv)
    if args.decode:
        print(json.dumps(decode(args.decode)))
        return 0
    if args.out is None:
        ap.error("--out is required")
    out: Path = args.out
    try:
        version = llama_cpp_version()
        converter: Path = args.converter or out.parent / f".llama-cpp-python-{version}"
        out.mkdir(parents=True, exist_ok=True)
        clear_leftovers(out)
        clear_leftovers(converter.parent, f".{converter.name}.*.tmp")  # the folder is shared: ours alone
        hf, f16 = out / "hf", out / "f16.gguf"
        model_name = f"random-llama-{args.shape}"  # general.name; else the converter names it after its folder, "Hf"
        if not hf.exists() and not args.tokenizer.is_file():
            raise FixtureError(f"{args.tokenizer} not found: `make smollm2` fetches it")
        step("hf", hf, lambda: build_folder(hf, lambda d: write_hf(d, SHAPES[args.shape], args.tokenizer, args.seed)))
        step("converter", converter, lambda: build_folder(converter, lambda d: fetch_converter(d, version)))
        step("f16", f16, lambda: atomic.replace_with(f16, lambda tmp: convert(hf, converter, tmp, model_name)))
        for name, ftype in QUANTS.items():
            q = out / f"{name}.gguf"
            step(name, q, lambda q=q, ftype=ftype: atomic.replace_with(q, lambda tmp: quantize(f16, tmp, ftype)))
        for name in ("f16", *QUANTS):
            path = out / f"{name}.gguf"
            t0 = time.monotonic()
            tokens = check(path)
            log(f"check {path.name}: {path.stat().st_size / 2**20:.1f} MiB, greedy {tokens} "
                f"({time.monotonic() - t0:.1f} s)")  # fmt: skip
        size = sum(p.stat().st_size for p in hf.iterdir())
        log(f"check hf: {size / 2**20:.1f} MiB")
    except (FixtureError, OSError, ValueError) as e:  # ValueError: smallem's on an unreadable --tokenizer file
        print(f"llama_fixture: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
