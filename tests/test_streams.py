"""Closed or full standard streams, as a shell makes them: a closed stdin is an empty input; a
closed or full stdout is one `error:` line and exit 1; a reader that goes away is a quiet exit
(141, as a command killed by SIGPIPE). Never a traceback."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Family

REPO = Path(__file__).resolve().parent.parent
CODE = "import sys; from smallem_cli.cli import main; sys.argv[0] = 'smallem'; main()"
SMALLEM = f"{shlex.quote(sys.executable)} -c {shlex.quote(CODE)}"


def shell(line: str) -> subprocess.CompletedProcess:
    """`line` run by bash, `smallem` standing for the command; its exit status is smallem's."""
    env = os.environ | {"PYTHONPATH": str(REPO), "SMALLEM_ENGINE": "eager"}
    script = f'set -o pipefail; smallem() {{ {SMALLEM} "$@"; }}; {line}'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)


def one_error(res: subprocess.CompletedProcess, message: str) -> None:
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr


def test_closed_stdin_is_an_empty_input(family: Family) -> None:
    res = shell(f"smallem generate --target {family.target} -n 5 <&-")
    assert res.returncode == 2
    one_error(res, "the prompt is empty")
    res = shell(f"smallem batch --target {family.target} -n 5 -q <&-")  # no requests: nothing to answer
    assert res.returncode == 0 and res.stdout == "" and "Traceback" not in res.stderr, res.stderr
    res = shell(f"smallem generate 'The fox' --target {family.target} -n 5 -q <&-")  # the prompt is given
    assert res.returncode == 0 and res.stdout.strip(), res.stderr


@pytest.mark.parametrize(("redirect", "message"), [(">&-", "stdout is closed"), (">/dev/full", "No space left")])
def test_closed_or_full_stdout_is_one_line(family: Family, redirect: str, message: str) -> None:
    for command in (
        f"generate 'The fox' --target {family.target} -n 5 -q",
        f"generate 'The fox' --target {family.target} -n 5 -q --json",
        f"batch --target {family.target} -n 5 -q <<< 'The fox'",
        "--help",
    ):
        res = shell(f"smallem {command} {redirect}")
        assert res.returncode == 1, (command, res.returncode, res.stderr[-2000:])
        one_error(res, message)


def test_a_command_that_prints_nothing_runs_with_stdout_closed(family: Family, tmp_path: Path) -> None:
    out = tmp_path / "export"
    res = shell(f"smallem export {family.target} {out} >&-")
    assert res.returncode == 0 and (out / "config.json").is_file(), res.stderr


def test_a_reader_that_goes_away_is_a_quiet_exit(family: Family) -> None:
    res = shell(f"smallem generate 'The fox' --target {family.target} -n 200 --proposer none | head -c 3")
    assert res.stdout  # three bytes, not always whole characters
    assert res.returncode == 141 and res.stderr == "", (res.returncode, res.stderr[-2000:])
    lines = "\n".join(["The fox"] * 40)
    res = shell(f"printf '{lines}' | smallem batch --target {family.target} -n 20 -q | head -n 1")
    assert res.stdout.count("\n") == 1
    assert res.returncode == 141 and res.stderr == "", (res.returncode, res.stderr[-2000:])


@pytest.mark.parametrize("tty", [True, False])
def test_model_text_drives_no_terminal(tty: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal a model's control characters are shown as pictures (an ESC could clear or remap
    the screen); a pipe or a file gets the text unchanged."""
    import io

    from smallem_cli.cli.console import text_out

    class Out(io.StringIO):
        def isatty(self) -> bool:
            return tty

    raw = Out()
    monkeypatch.setattr(sys, "stdout", raw)
    text = "a\x1b[2J\x1b(0b\tc\rd\x08\x7f\x9b\ne"
    out = text_out()
    assert out.write(text) == len(text)
    out.flush()
    assert raw.getvalue() == ("a␛[2J␛(0b\tc␍d␈␡\ufffd\ne" if tty else text)
