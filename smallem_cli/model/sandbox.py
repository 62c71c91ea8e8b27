"""Chat templates run here, in a child process with a budget: a template is code from whoever made the model file.
Jinja's sandbox stops a template from reaching Python, but not from working or allocating without end (nested
loops multiply, `'x' * 10**9` is one C call), and no guard inside a process can stop a C-level allocation. So
templates render in a small persistent child (this file run as a script: it imports jinja2, never torch or the
package) whose address space and CPU time are capped with `setrlimit`; the parent kills it when a render passes
its wall-time budget, and starts another at the next render. Requests and replies are JSON lines on its stdin
and stdout; one render at a time (a lock), so any thread may call `render`."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from typing import Any

MEMORY = 1 << 30  # the child's address space: over it a template's allocation fails (MemoryError), not the host
SECONDS = 2  # wall time of one render: real templates take milliseconds
START_SECONDS = 30  # the child's start (an interpreter and jinja2), apart from any render's budget
MAX_TEMPLATES = 8  # compiled templates the child keeps


class Refused(Exception):
    """`raise_exception(message)` in a template: it does not take this conversation."""


def _refuse(message: object) -> None:
    raise Refused(message)


def _line(text: object) -> str:
    return " ".join(str(text).split())[:300]


def _render(env: Any, compiled: dict[str, Any], req: dict[str, Any]) -> dict[str, str]:
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(used.ru_utime + used.ru_stime) + req["seconds"] + 1  # a backstop should the parent be gone
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu if hard == resource.RLIM_INFINITY else min(cpu, hard), hard))
    try:
        if (template := compiled.get(req["template"])) is None:
            if len(compiled) >= MAX_TEMPLATES:
                compiled.clear()
            template = compiled[req["template"]] = env.from_string(req["template"])
        text = template.render(**req["context"])
    except Refused as e:
        return {"refused": _line(e)}
    except MemoryError:  # what it allocated is freed as the error unwinds: the child goes on
        return {"budget": f"{MEMORY >> 30} GiB of memory"}
    except Exception as e:  # a template is a program: whatever it raises is its failure, on one line
        return {"failed": f"{type(e).__name__}: {_line(e)}".rstrip(": ")}
    if len(text) > req["max_chars"]:
        return {"budget": f"an output of more than {req['max_chars']} characters"}
    return {"text": text}


def _child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from datetime import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # as transformers renders: blocks trimmed, `{% break %}`, raise_exception and strftime_now
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_refuse, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    compiled: dict[str, Any] = {}
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        out.write(json.dumps(_render(env, compiled, json.loads(line))).encode("ascii") + b"\n")
        out.flush()


class Sandbox:
    """The parent's handle on the child: started at the first render, restarted after a kill, closed at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def render(self, template: str, context: dict[str, Any], max_chars: int) -> dict[str, str]:
        """{"text": ...}, or why not: {"refused": ...}, {"failed": ...} or {"budget": ...} (one line each)."""
        request = json.dumps({"template": template, "context": context, "max_chars": max_chars, "seconds": SECONDS})
        with self._lock:
            if (proc := self._started()) is None:
                return {"failed": "the sandbox that renders it did not start"}
            try:
                assert proc.stdin is not None
                proc.stdin.write(request.encode("ascii") + b"\n")
                proc.stdin.flush()
                reply = self._read(proc, time.monotonic() + SECONDS)
            except OSError:  # the child is gone (a broken pipe)
                reply = b""
            except BaseException:  # a Ctrl-C while it renders: its reply would answer the next request
                self._stop()
                raise
            if reply:
                return json.loads(reply)
            self._stop()
            return {"budget": f"{SECONDS} s of work" if reply is None else "the sandbox stopped"}

    @property
    def pid(self) -> int | None:
        """The child's process id, while one runs."""
        return None if self._proc is None else self._proc.pid

    def _started(self) -> subprocess.Popen[bytes] | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()  # a child that died: reaped (a fork's copy of this handle holds none: `forked`)
        # -I: isolated, so neither the working directory nor PYTHON* variables change what the child imports;
        # its own session, so a Ctrl-C at the terminal is the parent's alone
        cmd = [sys.executable, "-I", os.path.abspath(__file__)]
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
            )
        except OSError:
            return None
        self._proc = proc
        if not self._read(proc, time.monotonic() + START_SECONDS):
            self._stop()
            return None
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen[bytes], deadline: float) -> bytes | None:
        """The child's next line (b"" where it ended), or None where the deadline passed first."""
        assert proc.stdout is not None
        fd, got, ready = proc.stdout.fileno(), bytearray(), select.poll()  # poll: a server's fds pass 1024
        ready.register(fd, select.POLLIN)
        while not got.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not ready.poll(left * 1000):
                return None
            if not (chunk := os.read(fd, 1 << 20)):
                return b""
            got += chunk
        return bytes(got)

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:  # a pipe whose reader is gone
                    pass

    def forked(self) -> None:
        """In a fork's child: the parent's sandbox stays the parent's; this copy drops its pipes and any lock another
        thread held at the fork, and starts its own sandbox at its first render."""
        self._lock = threading.Lock()
        proc, self._proc = self._proc, None
        for pipe in (proc.stdin, proc.stdout) if proc is not None else ():
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def close(self) -> None:
        with self._lock:
            self._stop()


SANDBOX = Sandbox()
atexit.register(SANDBOX.close)
os.register_at_fork(after_in_child=SANDBOX.forked)

if __name__ == "__main__":
    _child()
