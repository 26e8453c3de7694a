"""The one error type the CLI edge turns into a single line (exit code 2), and the translation of expected
operating-system failures (disk full, permissions, a missing path) into the same shape. Anything else is a bug
and keeps its traceback."""

from __future__ import annotations

import errno
import sqlite3

_DISK_FULL = (
    "no space left on device",
    "database or disk is full",
    "disk quota exceeded",
    "file write failed",
)


class UserError(Exception):
    """A failure the user can fix (bad input, a missing path, a full disk); the message names the thing and the
    fix."""


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def expected_failure(error: BaseException) -> str | None:
    """One line for an expected failure anywhere in `error`'s chain (a `UserError`, a full disk, a permission
    or missing-path error from the OS), else None: an unexpected error, a bug."""
    chain = _chain(error)
    for link in chain:
        if isinstance(link, UserError):
            return str(link)
    for link in chain:
        text = str(link).lower()
        if (
            (isinstance(link, OSError) and link.errno in (errno.ENOSPC, errno.EDQUOT))
            or (
                isinstance(link, (RuntimeError, sqlite3.OperationalError, OSError))
                and any(marker in text for marker in _DISK_FULL)
            )
            or type(link).__name__ == "OperationalError"
            and "disk is full" in text
        ):
            where = getattr(link, "filename", None)
            return (
                f"disk full{f' writing {where}' if where else ''} ({str(link).splitlines()[0][:160]}): free space "
                "or point output_dir at a larger disk, then rerun the same command; finished steps and the last "
                "complete checkpoint are kept"
            )
    for link in chain:
        if isinstance(link, PermissionError) or (isinstance(link, OSError) and link.errno == errno.EROFS):
            return f"{link.filename or link}: not writable ({link.strerror}); fix its permissions or choose another path"
        if isinstance(link, FileNotFoundError) and link.filename:
            return f"{link.filename}: no such file or directory; check the path"
    return None
