"""A file written whole or not at all: written aside, then renamed over its destination.

The file aside is `.NAME.PID.tmp`, beside the destination (same folder: the rename is atomic),
named by the process. Two processes writing the same file (two training runs building one
corpus's token cache, say) each write their own and the last rename wins, both whole; with one
shared name, the second would truncate the first's file as it is written, and the first's rename
would then find nothing to rename. A writer that fails leaves the destination as it was and
takes its file aside with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def aside(out: Path) -> Path:
    """Where this process writes `out` before the rename."""
    return out.with_name(f".{out.name}.{os.getpid()}.tmp")


def replace_with(out: Path, write: Callable[[Path], None], sync: bool = False) -> None:
    """write(tmp) the file aside, then rename it to `out` (sync: on disk before the rename, so
    that a crash cannot leave an empty file behind the new name)."""
    tmp = aside(out)
    try:
        write(tmp)
        if sync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
