"""The `smallem` command: parse, load, call, print. Library modules never print."""

from __future__ import annotations

import sys

from .console import BROKEN_PIPE_EXIT, StdoutClosed, StdoutError, guard_streams, quiet_ctrl_c, stdout_to_devnull

quiet_ctrl_c()  # first: Ctrl-C while the libraries below load exits 130, without a traceback

from pathlib import Path  # noqa: E402
from typing import Annotated  # noqa: E402

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.text import Text  # noqa: E402

from . import defaults as D  # noqa: E402
from . import options as O  # noqa: E402

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Generate text from small language models with speculative decoding.",
)
# Markup off: messages hold paths and names the user chose, and `[/]` in one is not markup.
err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)


class _Tables:
    """Tables go to stdout (whatever it is when they print); wide enough to stay readable when piped."""

    def print(self, *objects: object) -> None:
        width = None if sys.stdout.isatty() else 200
        Console(file=sys.stdout, width=width, markup=False, highlight=False).print(*objects)


tables = _Tables()


def fail(msg: str, code: int = 2) -> typer.Exit:
    """Print `error: msg` as one line on stderr; the caller raises the returned Exit."""
    err.print(Text.assemble(("error:", "red"), " " + O.one_line(msg)), soft_wrap=True)
    return typer.Exit(code)


# --- evaluation ---------------------------------------------------------------------------
@app.command("eval")
def eval_cmd(
    target: Annotated[Path, typer.Option(help="target checkpoint")] = D.TARGET,
    data_dir: Annotated[Path, typer.Option("--data", help="folder with val.txt")] = D.DATA_DIR,
    drafts: Annotated[list[str] | None, typer.Option("--draft", help="draft names or paths")] = None,
    mtp: Annotated[Path | None, typer.Option(help="MTP module [default: mtp.safetensors beside the target]")] = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Validation loss (nats/byte) of each checkpoint, and each proposer's agreement with the target."""
    import json

    from . import data as corpus
    from .evaluate import chain_agreement, evaluate_family, load_members, report_table

    val_txt = data_dir / "val.txt"
    if not val_txt.is_file():
        raise fail(f"no validation text in {data_dir}: run `smallem data` (or `make data`) first")
    try:
        fam = load_members(target, drafts, mtp)
        ids = corpus.token_file(fam.target.tokenizer, val_txt)
        n_bytes = sum(len(d.encode("utf-8")) for d in corpus.read_documents(val_txt))
    except UnicodeDecodeError as e:
        raise fail(f"{val_txt} is not valid UTF-8 (byte {e.start})") from None
    except O.INPUT_ERRORS as e:
        raise fail(str(e)) from None
    reports = evaluate_family(fam.target.model, ids, n_bytes, fam.drafts, fam.mtp, cuts=fam.cuts)
    try:
        kept = chain_agreement(fam.target.model, ids, fam.drafts, fam.mtp)
    except ValueError as e:
        raise fail(str(e)) from None
    for r in reports:
        r.kept_at = kept.get(r.name)
    if json_out:
        rows = [r.__dict__ | {"training": fam.facts.get(r.name, {})} for r in reports]
        print(json.dumps({"val_tokens": len(ids), "val_bytes": n_bytes, "models": rows}))
        return
    tables.print(report_table(reports, fam.facts, len(ids), n_bytes))


@app.command()
def prompts(
    data_dir: Annotated[Path, typer.Option("--data", help="folder with val.txt")] = D.DATA_DIR,
    tokenizer: Annotated[Path, typer.Option(help="tokenizer.json")] = D.TOKENIZER,
    out: Annotated[Path, typer.Option(help="output file")] = D.PROMPTS,
    count: Annotated[int, typer.Option()] = 8,
    length: Annotated[int, typer.Option(help="tokens per prompt")] = 32,
    restate: Annotated[
        int, typer.Option(help="then the passage's first N tokens again: a text that restates itself (copying pays)")
    ] = 0,
    overwrite: Annotated[bool, typer.Option(help="replace an existing output file")] = False,
) -> None:
    """Write the benchmark prompts: COUNT prompts of LENGTH tokens from the validation text."""
    from . import bench

    val_txt = data_dir / "val.txt"
    if not val_txt.is_file():
        raise fail(f"no validation text in {data_dir}: run `smallem data` (or `make data`) first")
    if out.exists() and not overwrite:
        raise fail(f"{out} exists: pass --overwrite to replace it")
    if count < 1 or length < 1 or not 0 <= restate <= length:
        raise fail("--count and --length must be >= 1, and --restate between 0 and --length")
    try:
        bench.write_prompts(val_txt, tokenizer, out, count, length, restate)
    except O.INPUT_ERRORS as e:
        raise fail(str(e)) from None
    err.print(f"{count} prompts of {length + restate} tokens -> {out}")


# --- benchmark ----------------------------------------------------------------------------
@app.command()
def bench(
    target: Annotated[Path, typer.Option(help="target checkpoint")] = D.TARGET,
    proposers: Annotated[str, typer.Option(help="comma-separated proposers")] = "draft-2l,draft-4l,mtp",
    k: Annotated[str | None, typer.Option("-k", "--k", help="extra k values, e.g. 1,4")] = None,
    sweep_k: Annotated[str | None, typer.Option("--sweep-k", help="e.g. 1..6: every k for every proposer")] = None,
    modes: Annotated[str, typer.Option(help="greedy,sample")] = "greedy,sample",
    prompts_file: Annotated[
        Path | None, typer.Option("--prompts", help=f"[default: {D.PROMPTS.name}; --batch: {D.BATCH_PROMPTS.name}]")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = D.MAX_NEW_TOKENS,
    batch: Annotated[
        str | None, typer.Option(help="e.g. 1,4,16,64: the batch engine's throughput and latency at these sizes")
    ] = None,
    repeats: Annotated[int, typer.Option(help="timed runs per configuration (median)")] = D.BENCH_REPEATS,
    temperature: Annotated[float, typer.Option(help="for the sample mode")] = D.BENCH_TEMPERATURE,
    top_k: Annotated[int | None, typer.Option("--top-k", help="for the sample mode")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="for the sample mode")] = None,
    min_p: Annotated[float | None, typer.Option("--min-p", help="for the sample mode")] = None,
    device: Annotated[str, typer.Option()] = D.DEVICE,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    proposer_vocab: Annotated[
        int | None,
        typer.Option("--proposer-vocab", help="proposer head: top-N frequent tokens (0 = all) [default: per mode]"),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
    plot_file: Annotated[Path | None, typer.Option("--plot", help="PNG of speed-up against k")] = None,
    peer: Annotated[
        str | None, typer.Option(help="hf | llamacpp | vllm: time transformers, llama.cpp or vLLM side by side")
    ] = None,
    costs: Annotated[
        bool, typer.Option("--costs", help="only the stopwatch readings of c and v, --repeats of them (seconds)")
    ] = False,
    p_min: Annotated[
        float | None,
        typer.Option("--draft-p-min", help="also rows with adaptive depth: each model proposer at this p-min"),
    ] = None,
    engine_names: Annotated[
        str, typer.Option("--engines", help="eager, native-avx2, native, comma-separated (auto: eager,native on a CPU)")
    ] = D.ENGINE,
    tree: Annotated[
        str | None,
        typer.Option("--tree", help="also rows with token trees of N guesses (N or N,M,..): each MTP proposer"),
    ] = None,
    weights: Annotated[
        str,
        typer.Option(
            "--proposer-weights",
            help=f"int8 | f16 | int8,f16 (also rows P@f16): the proposer's native matrices [{D.PROPOSER_WEIGHTS}]",
        ),
    ] = D.PROPOSER_WEIGHTS,
) -> None:
    """The seed's measurement table: tokens/s, speed-up, acceptance, cost model."""
    import json

    import torch

    from . import bench as B
    from . import engines, family
    from . import report as R
    from .peer import peer_table, run_peer

    try:
        if O.threads(threads):
            torch.set_num_threads(threads)
        names = [p for p in proposers.split(",") if p]
        extra = O.parse_ks(k) if k else []
        sweep = O.parse_ks(sweep_k) if sweep_k else []
        mode_list = O.check_bench(modes, repeats, max_new_tokens, peer, plot_file is not None, costs)
        O.check_sampling(temperature, top_k, top_p, min_p=min_p)
        dev = family.pick_device(device)
        tgt = family.load_target(target, dev)
        trees = O.tree_names(names, O.tree_budgets(tree)) if tree else {}  # "mtp@tree12" -> ("mtp", 12)
        first, *others = O.weights_list(weights)
        stored = O.weights_names(names, others)  # "mtp@f16" -> ("mtp", "f16")
        if batch is not None:  # the batch engine's table instead: greedy, one run per size
            from .bench_batch import from_cli

            sizes = O.parse_sizes(batch)
            found = O.read_prompts(prompts_file or D.BATCH_PROMPTS, tgt.model.cfg, max_new_tokens, {"k": [D.MAX_K]})
            names = names + list(trees) + list(stored)
            batch_engines = engines.bench_engines(engines.chosen(engine_names), dev)
            rows = from_cli(
                tgt, dev, names, sizes, extra, found, max_new_tokens, err, tables, json_out, plot_file, batch_engines,
                first,
            )  # fmt: skip
            if any(not r.identical.startswith(f"{len(found)}/") for r in rows):
                raise fail("greedy identity FAILED in the batch engine", 1)
            return
        prompts_file = prompts_file or D.PROMPTS
        adaptive = O.adaptive_names(names, O.p_min(p_min)) if p_min else {}  # "mtp@p0.4" -> "mtp"
        names += list(adaptive) + list(trees) + list(stored)
        ks = O.bench_ks(names, mode_list, extra, sweep)
        prompt_ids = O.read_prompts(prompts_file, tgt.model.cfg, max_new_tokens, ks)
        O.check_vocab(proposer_vocab)
        vocab = {m: D.proposer_vocab(m == "greedy", proposer_vocab) for m in mode_list}
        loaded = {
            v: {
                n: family.load_proposer(
                    adaptive.get(n, trees[n][0] if n in trees else stored[n][0] if n in stored else n),
                    tgt,
                    dev,
                    v,
                    (p_min or 0.0) * (n in adaptive),
                    O.tree(trees[n][1]) if n in trees else None,
                    stored[n][1] if n in stored else first,
                )
                for n in names
            }
            for v in set(vocab.values())
        }
        engine_list = engines.bench_engines(engines.chosen(engine_names), dev)
    except O.INPUT_ERRORS as e:
        raise fail(str(e)) from None
    plan = B.Plan(
        {m: loaded[vocab[m]] for m in mode_list}, ks, mode_list, max_new_tokens, repeats, temperature, 0, engine_list,
        top_k, top_p, min_p,
    )  # fmt: skip
    passes = list(D.COST_PASSES) if costs else None
    B.prepare_engines(tgt.model, plan, err.print)  # every pass the bench takes, before the clock
    if costs:
        readings = B.cost_readings(tgt.model, plan, prompt_ids[0], repeats, passes)
        if json_out:
            print(json.dumps({"device": str(dev), "threads": torch.get_num_threads(), **readings.__dict__}))
        else:
            tables.print(R.costs_table(readings, str(dev), torch.get_num_threads()))
        return
    total = B.generations(plan, len(prompt_ids))
    from rich.progress import Progress

    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("bench", total=total)

        def step(label: str) -> None:
            bar.update(task, advance=1, description=escape(label))  # the bar's text is markup

        rows = B.run_bench(tgt.model, prompt_ids, plan, step)
    from .vllm_peer import VllmError

    try:
        peer_rows = (
            run_peer(
                peer,
                tgt,
                target.parent,
                prompt_ids,
                max_new_tokens,
                rows,
                engine_list,
                repeats,
                lambda m: err.print(m),
                B.best_greedy(rows, plan),
            )
            if peer
            else []
        )
    except VllmError as e:  # vLLM failed in its subprocess: its error line
        raise fail(str(e), 1) from None
    if plot_file:
        R.plot(rows, plot_file)
    if json_out:
        print(
            json.dumps(
                {
                    "device": str(dev),
                    "threads": torch.get_num_threads(),
                    "prompts": len(prompt_ids),
                    "max_new_tokens": max_new_tokens,
                    "repeats": repeats,
                    "rows": [r.__dict__ for r in rows],
                    "peer": peer_rows,
                }
            )
        )
    else:
        tables.print(R.table(rows, len(prompt_ids), max_new_tokens, repeats, str(dev), torch.get_num_threads()))
        if sweep:
            tables.print(R.sweep_table(rows))
        if peer_rows:
            tables.print(peer_table(peer_rows))
    bad = [r for r in rows if r.identical is not None and not r.identical.startswith(f"{len(prompt_ids)}/")]
    if bad:
        raise fail("greedy identity FAILED: " + ", ".join(f"{r.proposer} k={r.k}: {r.identical}" for r in bad), 1)


# --- generation -------------------------------------------------------------------------
@app.command()
def generate(
    prompt: Annotated[str | None, typer.Argument(help="prompt text; '-' or a pipe reads stdin")] = None,
    target: Annotated[Path, typer.Option(help="target checkpoint or Hugging Face Llama folder")] = D.TARGET,
    proposer: Annotated[
        str | None,
        typer.Option(help=D.PROPOSER_HELP),
    ] = None,
    k: Annotated[
        int | None, typer.Option("-k", "--k", help="proposals per round, 1..16 [default: per proposer and mode]")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = D.MAX_NEW_TOKENS,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = D.TEMPERATURE,
    top_k: Annotated[int | None, typer.Option("--top-k")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p")] = None,
    min_p: Annotated[float | None, typer.Option("--min-p", help="drop tokens < MIN_P x the top probability")] = None,
    penalty: Annotated[float, typer.Option("--repetition-penalty", help="on every token so far (1 = off)")] = 1.0,
    stops: Annotated[list[str] | None, typer.Option("--stop", help="end the text before it (repeatable)")] = None,
    seed: Annotated[int, typer.Option()] = D.SEED,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = D.DEVICE,
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizer.json [default: beside the target]")] = None,
    proposer_vocab: Annotated[
        int | None,
        typer.Option("--proposer-vocab", help="proposer head: top-N frequent tokens (0 = all) [default: per mode]"),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no statistics on stderr")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="one JSON object: text, tokens, stats")] = False,
    engine: Annotated[
        str, typer.Option(help="auto (native on a CPU; $SMALLEM_ENGINE if set) | native | native-avx2 | eager")
    ] = D.ENGINE,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads (default: all, fewer when other processes are running)")
    ] = None,
    p_min: Annotated[
        float,
        typer.Option("--draft-p-min", help="adaptive depth: stop a round's guesses below this confidence (0 = off)"),
    ] = D.P_MIN,
    tree: Annotated[int, typer.Option("--tree", help=D.TREE_HELP)] = D.TREE,
    weights: Annotated[str, typer.Option("--proposer-weights", help=D.WEIGHTS_HELP)] = D.PROPOSER_WEIGHTS,
) -> None:
    """Generate a continuation of PROMPT. The text goes to stdout, statistics to stderr."""
    import json

    import torch

    from . import engines, family
    from .generate import stream
    from .sampling import NonFiniteError, Sampling
    from .stats import Stats
    from .stops import StopPrinter
    from .tokenizer import load_tokenizer

    try:
        proposer = proposer or family.default_proposer(target, temperature == 0)
        kk = O.pick_k(proposer, k, temperature == 0)
        O.check_sampling(temperature, top_k, top_p, seed, min_p, penalty, stops)
        text = O.read_prompt(prompt, max_new_tokens)
        dev = family.pick_device(device)
        tgt = family.load_target(target, dev, tokenizer)
        O.check_vocab(proposer_vocab)
        make_proposer = family.load_proposer(
            proposer,
            tgt,
            dev,
            D.proposer_vocab(temperature == 0, proposer_vocab),
            O.p_min(p_min),
            O.tree(tree),
            weights,
        )
        tok = load_tokenizer(tgt.tokenizer)
        ids = tok.encode(text).ids
        O.check_context(len(ids), max_new_tokens, kk, tgt.model.cfg.max_seq_len)
        mode = engines.engine_mode(engines.chosen(engine), dev)
        n_threads = O.threads(threads) or O.threads_for_load(torch.get_num_threads())
        if n_threads:
            torch.set_num_threads(n_threads)
    except O.INPUT_ERRORS as e:
        raise fail(str(e)) from None
    # every model this run may use, given its native steps (built once) before the clock starts
    log = (lambda _: None) if quiet else err.print
    ready, passes = engines.prepare_engine(mode, tgt.model, make_proposer(8), [kk], log)
    used = mode if mode and ready == passes else "eager" if not ready else f"partly {mode}"

    sampling = Sampling(temperature, top_k, top_p, seed, min_p, penalty)
    stats = Stats(proposer, kk)
    eot = tok.token_to_id("<|endoftext|>")
    out = StopPrinter(tok, None if json_out else sys.stdout, stops or [])
    try:
        for chunk in stream(
            tgt.model, make_proposer(len(ids) + max_new_tokens + kk + 1), ids, max_new_tokens, kk, sampling, eot, stats
        ):
            if out.push(chunk):  # a stop string: the text ends before it, and generation here
                break
        out.push([], final=True)
    except KeyboardInterrupt:  # keep what was generated: printed, or in the JSON marked as interrupted
        if json_out:
            record = {"text": out.text, "tokens": out.ids, "stats": stats.as_dict(), "interrupted": True}
            print(json.dumps(record), flush=True)
        sys.stdout.flush()
        err.print("\ninterrupted")
        raise typer.Exit(130) from None
    except NonFiniteError as e:  # what was printed stays; the run stops loudly
        sys.stdout.flush()
        raise fail(str(e), 1) from None
    if json_out:
        print(json.dumps({"text": out.text, "tokens": out.ids, "stats": stats.as_dict()}))
    else:
        print()
    if not quiet:
        err.print(
            f"{stats.new_tokens} tokens in {stats.elapsed_s:.2f} s: {stats.tokens_per_s:.1f} tok/s, "
            f"acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_pass:.2f} tokens/pass "
            f"({stats.proposer}, k={stats.k}, {used})"
        )


from . import cli_batch, cli_export, cli_train  # noqa: E402, F401  (register `batch`, `export`, `data`, `train`)


def main() -> None:
    """The `smallem` entry point. Ctrl-C anywhere, the libraries' import included, exits 130 quietly;
    a reader of stdout that goes away ends the run quietly (141); stdout closed or full is one line, exit 1."""
    guard_streams()
    try:
        try:
            app()  # typer turns a KeyboardInterrupt in a command into exit 130
        finally:
            sys.stdout.flush()  # here, not at exit: a failure is told like any other write's
    except KeyboardInterrupt:  # one that lands in typer's own set-up, before any command runs
        raise SystemExit(130) from None
    except StdoutClosed:
        stdout_to_devnull()
        raise SystemExit(BROKEN_PIPE_EXIT) from None
    except StdoutError as e:
        stdout_to_devnull()
        err.print(Text.assemble(("error:", "red"), f" {e}"), soft_wrap=True)
        raise SystemExit(1) from None
