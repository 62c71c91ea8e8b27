"""A file written whole or not at all: written aside (`.NAME.PID.tmp`, one per process), then renamed
over its destination. Only a regular file, or nothing, is replaced (`NotRegularFileError`)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path


class NotRegularFileError(FileExistsError):
    """The destination is not what its writer replaces; an OSError, reported as a failed write is."""


_KINDS = {  # what an `lstat` mode is, in words, for a message
    stat.S_IFREG: "a regular file",
    stat.S_IFDIR: "a folder",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
}


def check_replaceable(out: Path, folder: bool = False) -> bool:
    """Whether `out` exists; NotRegularFileError unless it is a regular file (or with `folder` a folder)
    or nothing. lstat: a symbolic link is refused, as replacing it would change what it points at."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return False
    what = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    if folder and not stat.S_ISDIR(mode):
        raise NotRegularFileError(f"{out} exists and is {what}, not a folder: give another path")
    if not folder and not stat.S_ISREG(mode):
        raise NotRegularFileError(f"{out} is {what}: only a regular file is replaced; give another path")
    return True


def replace_with(out: Path, write: Callable[[Path], None], sync: bool = False) -> None:
    """write(tmp) the file aside, then rename it to `out` (sync: on disk before the rename)."""
    check_replaceable(out)  # before the write: a refusal leaves nothing aside
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if sync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        check_replaceable(out)  # again: `out` may have changed during a long write
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
