"""A conversation's cache outlives each answer (`Request.session`), and `smallem chat` drives it:
a turn prefills only what it adds, and answers as a fresh run of the whole conversation would."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import FAMILY_CFG, Family, Trained, noisy_copy, random_model
from engine_help import backend, proposer
from test_chat import TEMPLATE, hf_dir, write  # noqa: F401  (hf_dir: the fixture)
from typer.testing import CliRunner

from smallem_cli.cli.app import app
from smallem_cli.engine.build import build
from smallem_cli.engine.config import EngineConfig
from smallem_cli.engine.generate import answer
from smallem_cli.engine.request import Request
from smallem_cli.engine.scheduler import Engine
from smallem_cli.interop.hf import export_hf
from smallem_cli.model import checkpoint
from smallem_cli.stats import Stats

KINDS = ["none", "ngram", "draft", "mtp", "ngram+mtp"]


def chat_engine(trained: Trained, kind: str, engine: str) -> Engine:
    target = trained.model
    model = {"draft": noisy_copy(target, 0.05, seed=5), "mtp": trained.mtp, "ngram+mtp": trained.mtp}.get(kind)
    p = proposer(kind, target, model)
    return build(EngineConfig(target, p, backend(engine, target, *p.models), 0 if kind == "none" else 3))


def ask(engine: Engine, prompt: list[int], n: int, session: int | None = 0) -> tuple[list[int], Stats]:
    stats = Stats("p", 0)
    got = [t for chunk in answer(engine, Request(0, 0, tuple(prompt), n, session=session), stats) for t in chunk]
    return got, stats


@pytest.mark.parametrize("engine", ["eager", "native"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_turn_reuses_the_cache_and_answers_as_a_fresh_run(trained: Trained, kind: str, engine: str) -> None:
    period = trained.period
    eng = chat_engine(trained, kind, engine)
    first = period[:12]
    a1, s1 = ask(eng, first, 20)
    assert len(a1) == 20 and s1.reused == 0
    held = len(eng.pool.tables[eng.sessions[0].uid])
    assert held > 0 and eng.pool.used() == held  # the conversation's pages, and only those
    second = first + a1 + period[5:9]
    a2, s2 = ask(eng, second, 25)
    # the cache held every token of the first turn but, at most, its last
    assert len(first) + len(a1) - 1 <= s2.reused <= len(first) + len(a1)
    fresh = chat_engine(trained, kind, engine)
    assert a2 == ask(fresh, second, 25, session=None)[0]
    assert fresh.pool.used() == 0
    eng.pool.release(eng.sessions.pop(0).uid)  # what ending the conversation gives back
    assert eng.pool.used() == 0 and not eng.sessions
    eng.pool.check()


def test_a_rewritten_history_rolls_back_to_what_it_shares(trained: Trained) -> None:
    eng = chat_engine(trained, "mtp", "eager")
    first = trained.period[:16]
    ask(eng, first, 10)
    edited = [*first[:5], (first[5] + 1) % 64, *first[6:]]  # a token changed at position 5
    got, st = ask(eng, edited, 15)
    assert st.reused == 5
    assert got == ask(chat_engine(trained, "mtp", "eager"), edited, 15, session=None)[0]
    assert ask(eng, edited, 15)[1].reused == len(edited) - 1  # the same prompt again: all but its last token


@pytest.mark.parametrize("kind", ["draft", "mtp"])
def test_an_answer_stopped_between_rounds_keeps_its_cache(trained: Trained, kind: str) -> None:
    eng = chat_engine(trained, kind, "native")
    first = trained.period[:10]
    with contextlib.closing(answer(eng, Request(0, 0, tuple(first), 40, session=0))) as chunks:
        partial = next(chunks)  # the consumer stops here, as a Ctrl-C does
    assert 0 in eng.sessions and eng.pool.used() > 0
    second = first + partial + trained.period[3:6]
    got, st = ask(eng, second, 20)
    assert st.reused >= len(first) + len(partial) - 1
    assert got == ask(chat_engine(trained, kind, "native"), second, 20, session=None)[0]


# --- `smallem chat` ---------------------------------------------------------------------------
def chat(*args: str, input: str) -> object:
    return CliRunner().invoke(app, ["chat", "--engine", "eager", "-n", "12", *args], input=input)


def test_chat_answers_each_line_and_reuses_the_conversation(hf_dir: Path) -> None:  # noqa: F811
    res = chat("--target", str(hf_dir), "--system", "Answer", input="In the beginning\n\nthe word\n")
    assert res.exit_code == 0, res.stderr  # type: ignore[attr-defined]
    lines = res.stderr.splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 2, lines  # one statistics line a message; the empty line is skipped
    reused = [re.search(r"(\d+) of (\d+) prompt tokens from the cache", line) for line in lines]
    assert reused[0] and reused[0][1] == "0"  # type: ignore[index]
    assert reused[1] and 0 < int(reused[1][1]) < int(reused[1][2])  # type: ignore[index]
    assert res.stdout.count("\n") >= 2  # type: ignore[attr-defined]


def test_chat_refusals(family: Family, hf_dir: Path) -> None:  # noqa: F811
    res = chat("--target", str(family.target), input="hi\n")
    assert res.exit_code == 2 and "no chat template" in res.stderr and res.stderr.count("\n") == 1  # type: ignore[attr-defined]
    # a message past the context is refused on one line; the conversation goes on
    res = chat("--target", str(hf_dir), "-n", "250", input="hi\n")
    assert res.exit_code == 0 and res.stderr.startswith("error:") and "exceeds" in res.stderr  # type: ignore[attr-defined]


def test_ctrl_c_stops_the_answer_not_the_session(hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """SIGINT during the first answer: it stops, marked, and the next message is answered."""
    import smallem_cli.engine.generate as G

    original = G.answer
    calls = []

    def interrupted_once(*args: object, **kw: object) -> Iterator[list[int]]:
        calls.append(1)
        for i, chunk in enumerate(original(*args, **kw)):  # type: ignore[arg-type]
            if len(calls) == 1 and i == 1:
                signal.raise_signal(signal.SIGINT)
            yield chunk

    monkeypatch.setattr(G, "answer", interrupted_once)
    res = chat("--target", str(hf_dir), "-n", "40", input="In the beginning\nthe word\n")
    assert res.exit_code == 0, res.stderr  # type: ignore[attr-defined]
    lines = res.stderr.splitlines()  # type: ignore[attr-defined]
    assert lines[0] == "(interrupted)" and "tok/s" in lines[1] and len(calls) == 2


@pytest.fixture
def long_hf(family: Family, tmp_path: Path) -> Path:
    """A chat model with a long context and no end token: an answer runs to its budget, seconds long."""
    cfg = replace(FAMILY_CFG, dim=64, n_layers=4, hidden_dim=128, max_seq_len=8192, mtp=False)
    checkpoint.save(tmp_path / "target.safetensors", random_model(cfg, seed=0), tokenizer=family.fingerprint)
    out = tmp_path / "hf"
    export_hf(tmp_path / "target.safetensors", out, family.tokenizer)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        got = json.loads((out / name).read_text()) if (out / name).is_file() else {}
        got = {k: v for k, v in got.items() if k not in ("eos_token_id", "eos_token")}
        write(out, name, got | ({"chat_template": TEMPLATE} if name == "tokenizer_config.json" else {}))
    return out


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux drives a real terminal")
def test_chat_in_a_terminal(long_hf: Path, tmp_path: Path) -> None:
    """As a user: a prompt, an answer streamed, Ctrl-C mid-answer, Ctrl-C at the prompt, another
    message answered in full, Ctrl-D; exit 0."""
    session, rc = f"smallem-chat-{tmp_path.name}", tmp_path / "rc"
    smallem = Path(sys.executable).with_name("smallem")
    cmd = f"{smallem} chat --target {long_hf} --engine eager --threads 1 -n 3000; echo $? > {rc}"
    tmux = ["tmux", "-L", session]
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd], check=True)

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def wait_for(what: str | Callable[[str], bool], timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while not (what(screen()) if callable(what) else what in screen()):
            assert time.monotonic() < end, screen()
            time.sleep(0.05)

    def keys(*k: str) -> None:
        subprocess.run([*tmux, "send-keys", "-t", session, *k], check=True)

    try:
        wait_for(">")  # the prompt (the pane drops its trailing space)
        keys("In the beginning", "Enter")
        # Ctrl-C once the answer streams (3,000 tokens take seconds), not while the line is read
        wait_for(lambda text: len(text.split("In the beginning", 1)[-1].strip()) > 20)
        keys("C-c")
        wait_for("(interrupted)")  # whole: an ESC from a random model is shown, not obeyed
        keys("C-c")  # at the prompt: the line is cleared, the session goes on
        keys("the word", "Enter")
        wait_for("tok/s")
        keys("C-d")
        end = time.monotonic() + 60
        while not rc.exists():
            assert time.monotonic() < end, screen()
            time.sleep(0.05)
        assert rc.read_text().strip() == "0", screen()
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
