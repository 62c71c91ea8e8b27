"""`smallem serve`: an OpenAI-compatible HTTP server over the batch engine (the `serve` extra: uvicorn, starlette)."""

from __future__ import annotations

import functools
import math
import signal
import socket
import threading
from pathlib import Path
from typing import Annotated

import typer

from .. import defaults, options
from ..errors import UsageError, first_fault, one_line
from . import args
from .app import app, bad_input, err, fail, load_run


@app.command()
def serve(
    target: args.Target = defaults.TARGET,
    proposer: args.Proposer = None,
    k: args.K = None,
    host: Annotated[str, typer.Option(help="the address to listen on (another than 127.0.0.1 opens it to others)")] = (
        defaults.SERVE_HOST
    ),
    port: Annotated[int, typer.Option(help="0: a free port, printed on stderr")] = defaults.SERVE_PORT,
    max_batch: args.MaxBatch = defaults.MAX_BATCH,
    max_queue: Annotated[int, typer.Option(help="requests waiting, at most; more get 429")] = defaults.SERVE_QUEUE,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="SMALLEM_API_KEY", help="/v1/ requests need this bearer token")
    ] = None,
    model_name: Annotated[str | None, typer.Option(help="(default: the target's file name)")] = None,
    drain: Annotated[int, typer.Option(help="seconds SIGTERM waits for answers in flight")] = defaults.SERVE_DRAIN,
    stream_rate: Annotated[
        float, typer.Option(help="streamed events a second, at most, shared by the requests in flight (0: no limit)")
    ] = defaults.SERVE_STREAM_RATE,
    max_connections: Annotated[int | None, typer.Option(help=defaults.CONNECTIONS_HELP)] = None,
    header_timeout: Annotated[
        float, typer.Option(help="seconds a request's line and headers may take to arrive")
    ] = defaults.SERVE_HEADER_TIMEOUT,
    body_timeout: Annotated[
        float, typer.Option(help="seconds a request's body may take to arrive, after its headers")
    ] = defaults.SERVE_BODY_TIMEOUT,
    device: args.Device = defaults.DEVICE,
    threads: args.Threads = None,
    engine: args.Engine = defaults.ENGINE,
    tokenizer: args.Tokenizer = None,
    weights: args.Weights = defaults.PROPOSER_WEIGHTS,
    suffix_shared: Annotated[
        bool, typer.Option(help="`--proposer suffix` looks up every answer served before, not its request's text alone")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no access log")] = False,
) -> None:
    """Serve the target over HTTP: OpenAI's /v1/completions, /v1/chat/completions (streamed or whole) and
    /v1/models, with /health and /metrics (Prometheus). SIGTERM finishes the answers in flight, then exits 0."""
    try:
        import uvicorn

        from ..serve import guard
        from ..serve.app import create_app
    except ImportError as e:
        raise fail(f"smallem serve needs the serve extra: pip install 'smallem[serve]' (no {e.name})") from None
    from ..engine import family
    from ..model.chat import ChatError
    from ..serve.openai import Served, prompt_chars
    from ..serve.worker import Worker

    with bad_input():
        first_fault(
            (not 0 <= port <= 65535, f"--port must be between 0 and 65535, got {port}"),
            (max_queue < 1, f"--max-queue must be >= 1, got {max_queue}"),
            (drain < 1, f"--drain must be >= 1 second, got {drain}"),
            (not 0 <= stream_rate < math.inf, f"--stream-rate must be a number >= 0, got {stream_rate}"),
            (
                not 0 < header_timeout < math.inf,
                f"--header-timeout must be a number of seconds > 0, got {header_timeout}",
            ),
            (not 0 < body_timeout < math.inf, f"--body-timeout must be a number of seconds > 0, got {body_timeout}"),
        )
        limits = guard.Limits(_connections(max_connections, guard.connection_room()), header_timeout, body_timeout)
        proposer = proposer or family.default_proposer(target, True)
        slack = options.slack(proposer, k)
        sock = _bind(host, port)  # before the models load: a port in use fails at once
        vocab = defaults.proposer_vocab(True)  # a batch mixes modes: the greedy head, the default
        load = functools.partial(
            load_run, target, proposer, device, tokenizer, vocab, None, weights, engine, threads, quiet, k,
            max_batch=max_batch, share=False, suffix_shared=suffix_shared,
        )  # fmt: skip
        try:
            try:  # the chat template is tried before the weights load
                tgt, eng = load(chat=True)
            except ChatError as e:  # /v1/completions needs none: serve it, and say what the chat route will answer
                err.print(f"warning: {one_line(str(e))}; /v1/chat/completions will answer 400")
                tgt, eng = load(chat=False)
        except BaseException:
            sock.close()
            raise
    name = model_name or Path(target).name
    context = eng.context  # the model's, or what the memory holds
    served = Served(name, tgt.tok, tgt.chat, tgt.model.cfg.vocab_size, context, slack, prompt_chars(tgt.tok, context))
    guard.trim_heap()  # what loading freed goes back to the system: the server holds it for as long as it runs
    worker = Worker(eng, tgt.tok.decode, max_queue, stream_rate)
    config = uvicorn.Config(
        create_app(worker, served, api_key), log_level="warning" if quiet else "info", access_log=not quiet,
        timeout_graceful_shutdown=drain, lifespan="on", http=guard.protocol(limits), backlog=defaults.SERVE_BACKLOG,
    )  # fmt: skip
    server = uvicorn.Server(config)
    signals: list[int] = []

    def serve_http() -> None:
        try:
            server.run(sockets=[sock])
        finally:  # (after a drain its lifespan closed the engine already; after a failure, this does)
            worker.close(0)

    def stop(signum: int, frame: object) -> None:
        """SIGTERM or Ctrl-C: the HTTP side drains (its lifespan then closes the engine); a second one, at once."""
        signals.append(signum)
        server.should_exit = True
        if len(signals) > 1:
            raise KeyboardInterrupt

    http = threading.Thread(target=serve_http, name="smallem-http", daemon=True)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    bound_host, bound_port = sock.getsockname()[:2]
    err.print(f"serving {name} on http://{bound_host}:{bound_port} ({proposer}, max batch {eng.max_batch})")
    http.start()
    try:
        worker.run()  # the engine, here on the main thread, until the HTTP side closes it
        http.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signals and signals[0] == signal.SIGINT:
        raise typer.Exit(130)


def _connections(asked: int | None, room: int) -> int:
    """--max-connections, checked against what the file limit leaves (`guard.connection_room`)."""
    if asked is None:
        if room < 1:
            raise UsageError("the open-file limit leaves no room for connections: raise it (ulimit -n)")
        return min(defaults.SERVE_MAX_CONNECTIONS, room)
    if not 1 <= asked <= room:
        raise UsageError(
            f"--max-connections must be between 1 and {max(room, 1)} (the open-file limit's room), got {asked}"
        )
    return asked


def _bind(host: str, port: int) -> socket.socket:
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # no Nagle (accepted sockets inherit it): a streamed chunk, or a body after its headers, goes out at
        # once instead of waiting for the client's delayed ACK (40 ms a response)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(info[4])
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(defaults.SERVE_BACKLOG)
    sock.set_inheritable(True)
    return sock
