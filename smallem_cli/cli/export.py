"""`smallem export`: a checkpoint as a Hugging Face folder, a GGUF file, or a MiMo folder for vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from .app import app, bad_input, err


@app.command()
def export(
    checkpoint_path: Annotated[Path, typer.Argument(metavar="CHECKPOINT", help="a smallem model checkpoint")],
    out: Annotated[Path, typer.Argument(metavar="OUT", help="output: a folder (hf, mimo) or a .gguf file (gguf)")],
    fmt: Annotated[str, typer.Option("--format", help="hf | gguf | mimo (see above)")] = "hf",
    dtype: Annotated[str | None, typer.Option(help="gguf: f32 (default) | f16; hf, mimo keep the stored dtype")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizer.json (default: beside the checkpoint)")] = None,
    mtp: Annotated[Path | None, typer.Option(help="mimo: the MTP module (default: mtp.safetensors beside)")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing OUT (a non-empty folder, a file)")] = False,
) -> None:
    """Write a checkpoint as a Hugging Face LlamaForCausalLM folder (config.json, model.safetensors, tokenizer),
    as a GGUF file that llama.cpp runs (--format gguf), or with its MTP module as one MiMoForCausalLM folder
    for vLLM's mtp method (--format mimo)."""
    from ..interop.hf import export_hf

    tok = tokenizer or checkpoint_path.parent / "tokenizer.json"
    with bad_input(ImportError):  # an optional package missing
        if dtype is not None and fmt != "gguf":
            raise UsageError(f"--dtype applies to --format gguf: {fmt} keeps the checkpoint's dtype")
        if mtp is not None and fmt != "mimo":
            raise UsageError("--mtp applies to --format mimo")
        if fmt == "hf":
            export_hf(checkpoint_path, out, tok, overwrite=overwrite)
        elif fmt == "gguf":
            from ..interop.gguf import export_gguf

            export_gguf(checkpoint_path, out, tok, dtype=dtype or "f32", overwrite=overwrite)
        elif fmt == "mimo":
            from ..interop.hf import export_mimo

            module = mtp or checkpoint_path.parent / "mtp.safetensors"
            export_mimo(checkpoint_path, module, out, tok, overwrite=overwrite)
        else:
            raise UsageError(f"unknown --format {fmt!r}: use hf, gguf or mimo")
    err.print(f"{checkpoint_path} -> {out}")
