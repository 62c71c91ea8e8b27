"""A file written whole or not at all: written aside, then renamed over its destination.

The file aside is `.NAME.PID.tmp` in the destination's folder (so the rename is atomic), one per
process: two processes writing one file (two runs building one token cache) each rename a whole
file, the last winning, where one shared name would have the second truncate the first's. A writer
that fails leaves the destination as it was and removes its file aside. Only a regular file, or
nothing, is replaced: a rename would silently turn `/dev/null`, a FIFO, a socket or a device into a
regular file, so anything else is refused (`NotRegularFileError`) before the write and before the rename.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path


class NotRegularFileError(FileExistsError):
    """The destination exists and is not what its writer replaces (a regular file, or a folder for an
    export's folder). An OSError, so every command reports it as it reports a failed write."""


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
    """Whether `out` exists; NotRegularFileError unless it is what a writer replaces (a regular file,
    or with `folder` a folder) or nothing. Judged with lstat: a symbolic link is refused, as replacing
    it would turn it into a file, or replace what it points at (`/dev/stdout` is one), or leave the
    folder it points at with the old content."""
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
    """write(tmp) the file aside, then rename it to `out` (sync: on disk before the rename, so a crash
    cannot leave an empty file). NotRegularFileError, nothing written, if `out` is no regular file."""
    check_replaceable(out)  # before the write: a refusal costs nothing and leaves nothing aside
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if sync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        # Again just before the rename: `out` may have changed during a long write (what appears in
        # the instant between is still replaced: no portable rename refuses to replace).
        check_replaceable(out)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
