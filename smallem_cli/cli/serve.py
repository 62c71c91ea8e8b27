"""`smallem serve`: an OpenAI-compatible HTTP server over the batch engine (the `serve` extra: uvicorn, starlette)."""

from __future__ import annotations

import signal
import socket
import threading
from pathlib import Path
from typing import Annotated

import typer

from .. import defaults as D
from .. import options as O
from . import app as A
from .app import app, bad_input, err


@app.command()
def serve(
    target: A.Target = D.TARGET,
    proposer: A.Proposer = None,
    k: A.K = None,
    host: Annotated[str, typer.Option(help="the address to listen on (another than 127.0.0.1 opens it to others)")] = (
        D.SERVE_HOST
    ),
    port: Annotated[int, typer.Option(help="0: a free port, printed on stderr")] = D.SERVE_PORT,
    max_batch: Annotated[int, typer.Option("--max-batch", help="requests decoded together, at most")] = D.MAX_BATCH,
    max_queue: Annotated[int, typer.Option("--max-queue", help="requests waiting, at most; more get 429")] = (
        D.SERVE_QUEUE
    ),
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="SMALLEM_API_KEY", help="/v1/ requests need this bearer token")
    ] = None,
    model_name: Annotated[str | None, typer.Option("--model-name", help="(default: the target's file name)")] = None,
    drain: Annotated[int, typer.Option("--drain", help="seconds SIGTERM waits for answers in flight")] = D.SERVE_DRAIN,
    stream_rate: Annotated[
        float,
        typer.Option(
            "--stream-rate", help="streamed events a second, at most, shared by the requests in flight (0: no limit)"
        ),
    ] = D.SERVE_STREAM_RATE,
    device: A.Device = D.DEVICE,
    threads: A.Threads = None,
    engine: A.Engine = D.ENGINE,
    tokenizer: A.Tokenizer = None,
    weights: A.Weights = D.PROPOSER_WEIGHTS,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no access log")] = False,
) -> None:
    """Serve the target over HTTP: OpenAI's /v1/completions, /v1/chat/completions (streamed or whole) and
    /v1/models, with /health and /metrics (Prometheus). SIGTERM finishes the answers in flight, then exits 0."""
    try:
        import uvicorn

        from ..serve.app import create_app
    except ImportError as e:
        raise A.fail(f"smallem serve needs the serve extra: pip install 'smallem[serve]' (no {e.name})") from None
    from ..engine import family
    from ..serve.openai import Served
    from ..serve.worker import Worker
    from .batch import load_engine

    with bad_input():
        if not 0 <= port <= 65535:
            raise O.UsageError(f"--port must be between 0 and 65535, got {port}")
        if max_queue < 1:
            raise O.UsageError(f"--max-queue must be >= 1, got {max_queue}")
        if drain < 1:
            raise O.UsageError(f"--drain must be >= 1 second, got {drain}")
        if not 0 <= stream_rate < float("inf"):
            raise O.UsageError(f"--stream-rate must be a number >= 0, got {stream_rate}")
        proposer = proposer or family.default_proposer(target, True)
        slack = O.slack(proposer, k)
        sock = _bind(host, port)  # before the models load: a port in use fails at once
        tgt, eng = load_engine(target, proposer, k, max_batch, device, threads, engine, tokenizer, weights, quiet)
    name = model_name or Path(target).name
    cfg = tgt.model.cfg
    served = Served(name, tgt.tok, tgt.chat, cfg.vocab_size, cfg.max_seq_len, slack)
    worker = Worker(eng, tgt.tok.decode, max_queue, stream_rate)
    config = uvicorn.Config(
        create_app(worker, served, api_key), log_level="warning" if quiet else "info", access_log=not quiet,
        timeout_graceful_shutdown=drain, lifespan="on",
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
        raise O.UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(256)
    sock.set_inheritable(True)
    return sock
