"""`smallem bench` (the seed's measurement table) and `smallem prompts` (its prompt files)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from .. import defaults, options
from ..errors import UsageError
from .app import app, bad_input, err, fail, tables
from .args import DataDir, Device, ProposerVocab, Threads


@app.command()
def prompts(
    data_dir: DataDir = defaults.DATA_DIR,
    tokenizer: Annotated[Path, typer.Option(help="tokenizer.json")] = defaults.TOKENIZER,
    out: Annotated[Path, typer.Option(help="output file")] = defaults.PROMPTS,
    count: Annotated[int, typer.Option()] = 8,
    length: Annotated[int, typer.Option(help="tokens per prompt")] = 32,
    restate: Annotated[int, typer.Option(help="append its first N tokens: a self-restating text (copying pays)")] = 0,
    overwrite: Annotated[bool, typer.Option(help="replace an existing output file")] = False,
) -> None:
    """Write the benchmark prompts: COUNT prompts of LENGTH tokens from the validation text."""
    from ..bench import run as bench

    val_txt = data_dir / "val.txt"
    if not val_txt.is_file():
        raise fail(f"no validation text in {data_dir}: run `smallem data` (or `make data`) first")
    if out.exists() and not overwrite:
        raise fail(f"{out} exists: pass --overwrite to replace it")
    if count < 1 or length < 1 or not 0 <= restate <= length:
        raise fail("--count and --length must be >= 1, and --restate between 0 and --length")
    with bad_input():
        bench.write_prompts(val_txt, tokenizer, out, count, length, restate)
    err.print(f"{count} prompts of {length + restate} tokens -> {out}")


@app.command()
def bench(
    target: Annotated[Path, typer.Option(help="target checkpoint")] = defaults.TARGET,
    proposers: Annotated[str | None, typer.Option(help=defaults.BENCH_PROPOSERS_HELP)] = None,
    k: Annotated[str | None, typer.Option("-k", "--k", help="extra k values, e.g. 1,4")] = None,
    sweep_k: Annotated[str | None, typer.Option("--sweep-k", help="e.g. 1..6: every k for every proposer")] = None,
    modes: Annotated[str, typer.Option(help="greedy,sample")] = "greedy,sample",
    prompts_file: Annotated[
        Path | None,
        typer.Option("--prompts", help=f"(default: {defaults.PROMPTS.name}; --batch: {defaults.BATCH_PROMPTS.name})"),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = defaults.MAX_NEW_TOKENS,
    batch: Annotated[str | None, typer.Option(help="e.g. 1,4,16,64: batch engine throughput, latency per size")] = None,
    repeats: Annotated[int, typer.Option(help="timed runs per configuration (median)")] = defaults.BENCH_REPEATS,
    temperature: Annotated[float, typer.Option(help="for the sample mode")] = defaults.BENCH_TEMPERATURE,
    top_k: Annotated[int | None, typer.Option("--top-k", help="for the sample mode")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="for the sample mode")] = None,
    min_p: Annotated[float | None, typer.Option("--min-p", help="for the sample mode")] = None,
    device: Device = defaults.DEVICE,
    threads: Threads = None,
    proposer_vocab: ProposerVocab = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
    plot_file: Annotated[Path | None, typer.Option("--plot", help="PNG of speed-up against k")] = None,
    peer: Annotated[str | None, typer.Option(help="hf | llamacpp | vllm: time transformers/llama.cpp/vLLM too")] = None,
    engine_names: Annotated[
        str, typer.Option("--engines", help="eager, native-avx2, native, comma-separated (auto: eager,native on a CPU)")
    ] = defaults.ENGINE,
    tree: Annotated[
        str | None, typer.Option(help="also MTP rows with token trees of N draft tokens (N or N,M,..)")
    ] = None,
    proposer_weights: Annotated[
        str, typer.Option(help="int8 | f16 | int8,f16 (also rows P@f16): the proposer's native matrices")
    ] = defaults.PROPOSER_WEIGHTS,
    serve: Annotated[
        bool, typer.Option("--serve", help="time servers under --clients: smallem's, --url's, --peer vllm's")
    ] = False,
    clients: Annotated[str, typer.Option(help="--serve: concurrent streaming clients, e.g. 1,8,32")] = "1,8,32",
    per_client: Annotated[int, typer.Option("--requests-per-client", help="--serve: requests each")] = 4,
    url: Annotated[str | None, typer.Option(help="--serve: an OpenAI-compatible server already running")] = None,
    model: Annotated[str | None, typer.Option(help="--serve --url: the model name it serves")] = None,
) -> None:
    """The seed's measurement table: tokens/s, speed-up, acceptance, cost model. A prompts file's line
    is {"tokens": ids}, {"text": ...} (the target's tokenizer) or {"messages": [...]} (its chat template)."""
    import json

    import torch
    from rich.progress import Progress

    from ..backends import engines
    from ..bench import run as bench_run
    from ..bench.batch import from_cli
    from ..bench.peer import peer_table, run_peer
    from ..engine import family
    from ..engine.build import auto_k
    from ..interop.vllm_peer import VllmError, find_python
    from ..spec.sampling import Sampling

    with bad_input():
        if options.threads(threads):
            torch.set_num_threads(threads)
        extra = options.parse_ks(k) if k else []
        sweep = options.parse_ks(sweep_k) if sweep_k else []
        mode_list = options.check_bench(modes, repeats, max_new_tokens, peer, plot_file is not None)
        if peer == "vllm":  # vLLM lives in a venv of its own (.venv-vllm): its python must be there
            try:
                find_python()
            except VllmError as e:
                raise UsageError(f"--peer vllm: {e}") from None
        options.check_sampling(temperature, top_k, top_p, min_p=min_p)
        dev = family.pick_device(device)
        tgt = family.load_target(target, dev)
        if peer in ("hf", "vllm") and (tgt.tokenizer is None or tgt.hf):  # they run exports of the family
            raise UsageError(f"--peer {peer} needs a smallem checkpoint as --target (it exports it for the peer)")
        names = [p for p in proposers.split(",") if p] if proposers is not None else family.bench_proposers(tgt)
        budgets = options.tree_budgets(tree) if tree else []
        first, *others = options.weights_list(proposer_weights)
        mtp = [n for n in names if "+" not in n and "mtp" in Path(n).stem]  # the proposers that take token trees
        rows_of = {n: (n, None, first) for n in names}  # a row -> its proposer, tree and weights
        rows_of |= {f"{n}@tree{b}": (n, options.tree(b), first) for n in mtp for b in budgets}  # "mtp@tree12"
        rows_of |= {
            f"{n}@{w}": (n, None, w) for n in names if n not in ("none", defaults.NGRAM) for w in others
        }  # "mtp@f16"
        engine_list = engines.bench_engines(engines.chosen(engine_names), dev)
        # each row's k values: the sweep, else its defaults for the modes and the extra ones
        ks = {n: sweep or sorted({*(defaults.default_k(n, m == "greedy") for m in mode_list), *extra}) for n in rows_of}
        sizes = [] if serve or batch is None else options.parse_sizes(batch)  # before the prompts are read
        many = serve or batch is not None  # a server's clients or the batch engine: a prompt a request, any k
        room = {"k": [defaults.MAX_K]} if many else ks
        default_file = defaults.BATCH_PROMPTS if many else defaults.PROMPTS
        found = options.read_prompts(
            prompts_file or default_file, tgt.model.cfg, max_new_tokens, room, tgt.tok, tgt.chat
        )
        if serve:  # a server process per proposer, its clients here
            if per_client < 1:
                raise UsageError(f"--requests-per-client must be >= 1, got {per_client}")
            drawn = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": defaults.SEED}
            fields = {"greedy": {"temperature": 0.0}, "sample": drawn}
            args = ["--device", device, "--engine", engine_list[-1], *(["--threads", str(threads)] if threads else [])]
            from ..bench import serve as bench_serve

            if peer not in (None, "vllm"):
                raise UsageError(f"--serve takes --peer vllm (`vllm serve`), not --peer {peer}")
            vllm = (target, tgt.tokenizer, torch.get_num_threads()) if peer == "vllm" and tgt.tokenizer else None
            try:
                rows = bench_serve.from_cli(
                    str(target), names, url, model, found, options.parse_sizes(clients), per_client, max_new_tokens,
                    {m: fields[m] for m in mode_list}, args, vllm,
                )  # fmt: skip
            except (bench_serve.ServerError, VllmError, OSError) as e:
                raise fail(str(e), 1) from None
            if json_out:
                print(json.dumps({"prompts": len(found), "max_new_tokens": max_new_tokens} | {
                    "serve_rows": [r.__dict__ for r in rows]}))  # fmt: skip
            else:
                tables.print(bench_serve.table(rows, max_new_tokens))
            if any(r.identical != "-" and not r.identical.startswith(f"{r.requests}/") for r in rows):
                raise fail("greedy identity FAILED across servers or client counts", 1)
            return
        if batch is not None:  # the batch engine's table instead: greedy, the median of --repeats runs per size
            rows = from_cli(
                tgt, dev, list(rows_of), sizes, extra, found, max_new_tokens, err, tables, json_out, plot_file,
                engine_list, first, repeats,
            )  # fmt: skip
            if any(not r.identical.startswith(f"{len(found)}/") for r in rows):
                raise fail("greedy identity FAILED in the batch engine", 1)
            return
        vocab = {m: options.proposer_vocab(m == "greedy", proposer_vocab) for m in mode_list}
        loaded = {
            v: {n: family.load_proposer(p, tgt, dev, v, t, w) for n, (p, t, w) in rows_of.items()}
            for v in set(vocab.values())
        }
    draws = Sampling(temperature, top_k, top_p, min_p=min_p)
    plan = bench_run.Plan(
        {m: loaded[vocab[m]] for m in mode_list}, ks, mode_list, max_new_tokens, repeats, engine_list, draws
    )
    bench_run.prepare_engines(tgt.model, plan, err.print)  # every pass the bench takes, before the clock
    if not sweep and not extra:  # an EAGLE head's k: the cost model's on this machine, shown in its rows
        fastest = plan.backends[engines.fastest(plan.engines)]
        for n in rows_of:
            if (auto := auto_k(tgt.model, plan.proposers[mode_list[0]][n], fastest)) is not None:
                plan.ks[n] = [auto]
    head = {"device": str(dev), "threads": torch.get_num_threads()}
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("bench", total=bench_run.generations(plan, len(found)))
        # the bar's text is markup
        rows = bench_run.run_bench(tgt.model, found, plan, lambda s: bar.update(task, advance=1, description=escape(s)))
    try:
        peer_rows = run_peer(peer, tgt, target.parent, found, rows, plan, err.print) if peer else []
    except VllmError as e:  # vLLM failed in its subprocess: its error line
        raise fail(str(e), 1) from None
    if plot_file:
        bench_run.plot(rows, plot_file)
    if json_out:
        run = {"max_new_tokens": max_new_tokens, "repeats": repeats, "rows": [r.__dict__ for r in rows]}
        print(json.dumps(head | {"prompts": len(found)} | run | {"peer": peer_rows}))
    else:
        tables.print(bench_run.table(rows, len(found), max_new_tokens, repeats, str(dev), torch.get_num_threads()))
        if sweep:
            tables.print(bench_run.sweep_table(rows))
        if peer_rows:
            tables.print(peer_table(peer_rows))
    if bad := [r for r in rows if r.identical is not None and not r.identical.startswith(f"{len(found)}/")]:
        raise fail("greedy identity FAILED: " + ", ".join(f"{r.proposer} k={r.k}: {r.identical}" for r in bad), 1)
