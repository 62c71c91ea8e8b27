"""A file written whole or not at all: written aside, then renamed over its destination.

The file aside is `.NAME.PID.tmp`, beside the destination (same folder: the rename is atomic),
named by the process. Two processes writing the same file (two training runs building one
corpus's token cache, say) each write their own and the last rename wins, both whole; with one
shared name, the second would truncate the first's file as it is written, and the first's rename
would then find nothing to rename. A writer that fails leaves the destination as it was and
takes its file aside with it.

Only a regular file, or a path that does not exist, is ever replaced. A rename replaces whatever
has the name: `/dev/null`, a FIFO, a socket or a device node would silently become a
regular file (and, as root, a system's `/dev/null` with it), so anything else is refused
(`NotRegularFileError`) before the write and again right before the rename.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path


class NotRegularFileError(FileExistsError):
    """The destination exists and is not what its writer replaces (a regular file, or a folder for
    an export's folder): it is never replaced. An OSError, so
    that every command that reports a failed write as one line reports this one too."""


def kind(mode: int) -> str:
    """What an `lstat` mode is, in words, for a message."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_replaceable(out: Path, folder: bool = False) -> bool:
    """Whether `out` exists; NotRegularFileError unless it is what a writer replaces (a regular
    file, or with `folder` a folder) or nothing.

    Judged with lstat, so a symbolic link is judged as a link, and refused: replacing it would
    either turn the link into a file or, written through, replace what it points at (`/dev/stdout`
    is one, into /proc); a folder swapped in for a link would leave the folder it points at with
    the old content. Neither is what a writer of `out` asked for, so the user is told instead.
    """
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return False
    if folder and not stat.S_ISDIR(mode):
        raise NotRegularFileError(f"{out} exists and is {kind(mode)}, not a folder: give another path")
    if not folder and not stat.S_ISREG(mode):
        raise NotRegularFileError(f"{out} is {kind(mode)}: only a regular file is replaced; give another path")
    return True


def aside(out: Path) -> Path:
    """Where this process writes `out` before the rename."""
    return out.with_name(f".{out.name}.{os.getpid()}.tmp")


def replace_with(out: Path, write: Callable[[Path], None], sync: bool = False) -> None:
    """write(tmp) the file aside, then rename it to `out` (sync: on disk before the rename, so
    that a crash cannot leave an empty file behind the new name). NotRegularFileError, and nothing
    written, if `out` exists and is not a regular file (`check_replaceable`)."""
    check_replaceable(out)  # before the write: a refusal costs nothing and leaves nothing aside
    tmp = aside(out)
    try:
        write(tmp)
        if sync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        # Again just before the rename: `out` may have changed during a long write. What is
        # created in the instant between this check and the rename is still replaced; only a
        # rename that refuses to replace (none portable) would close that window.
        check_replaceable(out)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
