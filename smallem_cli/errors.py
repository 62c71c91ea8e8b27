"""The errors bad input raises, below every layer that notices it: the CLI reports each as one line, exit 2."""


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit 2."""


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not fit what it is used for."""


class BadField(ValueError):
    """One field of a request (`smallem batch`'s lines, `smallem serve`'s bodies) of the wrong type or out of range."""


# What bad input raises, whichever module notices it (CheckpointError, HFFormatError, TokenizerError, ConfigError and
# UnicodeDecodeError are ValueErrors).
INPUT_ERRORS = (UsageError, ValueError, OSError)


def one_line(msg: str) -> str:
    """An error message on one line (a library's message may hold newlines)."""
    return " ".join(msg.split()) if "\n" in msg or "\r" in msg else msg


def first_fault(*rules: tuple[object, str]) -> None:
    """Checks written as a table of (fault, message): UsageError with the message of the first fault that holds."""
    for fault, message in rules:
        if fault:
            raise UsageError(message)
