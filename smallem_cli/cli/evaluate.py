"""`smallem eval`: each checkpoint's validation loss, and each proposer's agreement with the target."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import defaults
from ..errors import INPUT_ERRORS
from . import args
from .app import app, fail, tables


@app.command("eval")
def eval_cmd(
    target: Annotated[Path, typer.Option(help="target checkpoint")] = defaults.TARGET,
    data_dir: args.DataDir = defaults.DATA_DIR,
    drafts: Annotated[list[str] | None, typer.Option("--draft", help="draft names or paths")] = None,
    mtp: Annotated[Path | None, typer.Option(help="MTP module (default: mtp.safetensors beside the target)")] = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Validation loss (nats/byte) of each checkpoint, and each proposer's agreement with the target."""
    import json

    from ..train import data as corpus
    from ..train.evaluate import chain_agreement, evaluate_family, load_members, report_table

    val_txt = data_dir / "val.txt"
    if not val_txt.is_file():
        raise fail(f"no validation text in {data_dir}: run `smallem data` (or `make data`) first")
    try:
        fam = load_members(target, drafts, mtp)
        ids = corpus.token_file(fam.target.tokenizer, val_txt, fam.target.tok)
        n_bytes = sum(len(d.encode("utf-8")) for d in corpus.read_documents(val_txt))
        reports = evaluate_family(fam.target.model, ids, n_bytes, fam.drafts, fam.mtp, cuts=fam.cuts)
        kept = chain_agreement(fam.target.model, ids, fam.drafts, fam.mtp)  # ValueError: a text too short
    except UnicodeDecodeError as e:
        raise fail(f"{val_txt} is not valid UTF-8 (byte {e.start})") from None
    except INPUT_ERRORS as e:
        raise fail(str(e)) from None
    for r in reports:
        r.kept_at = kept.get(r.name)
    if json_out:
        rows = [r.__dict__ | {"training": fam.facts.get(r.name, {})} for r in reports]
        print(json.dumps({"val_tokens": len(ids), "val_bytes": n_bytes, "models": rows}))
        return
    tables.print(report_table(reports, fam.facts, len(ids), n_bytes))
