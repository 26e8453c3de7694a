"""The one error type the CLI edge turns into a single line (exit code 2), and the translation of expected
operating-system failures (disk full, permissions, a missing path) into the same shape. Anything else is a bug
and keeps its traceback."""

from __future__ import annotations

import errno
import os

_DISK_FULL = (
    "no space left on device",
    "database or disk is full",
    "disk quota exceeded",
    "file write failed",
)

_FREE_SPACE = (
    "free space or point output_dir at a larger disk, then rerun the same command (it resumes from the last "
    "complete checkpoint, which a failed write never replaces)"
)


class UserError(Exception):
    """A failure the user can fix (bad input, a missing path, a full disk); the message names the thing and the
    fix."""


class Preempted(UserError):
    """Training stopped on a signal after writing a checkpoint: the same command resumes from it."""


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and what it was raised from or during, outermost first, as a traceback shows them (`from None`
    ends the chain)."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return seen


def root_cause(error: BaseException) -> BaseException:
    """The first failure in `error`'s chain."""
    return _chain(error)[-1]


def bad_input(error: BaseException) -> bool:
    """Whether `error` ends in one line rather than a traceback: a `UserError`, a library's `ValueError` (its
    validation message) or an expected failure (`expected_failure`); anything else is a bug."""
    return isinstance(error, UserError | ValueError) or expected_failure(error) is not None


def expected_failure(error: BaseException) -> str | None:
    """One line for an expected failure anywhere in `error`'s chain (a `UserError`, a full disk, an OS error on
    a named path), else None: an unexpected error, a bug."""
    chain = _chain(error)
    for link in chain:
        if isinstance(link, UserError):
            return str(link)
    for link in reversed(chain):  # the first failure, not a later write that the full disk refused as well
        text = str(link).lower()
        first = str(link).splitlines()[0][:160] if str(link) else type(link).__name__
        if isinstance(link, OSError) and link.strerror:  # without the file name, which `where` gives
            first = f"[Errno {link.errno}] {link.strerror}"
        if (isinstance(link, OSError) and link.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
            marker in text for marker in _DISK_FULL
        ):
            where = f" writing {link.filename}" if getattr(link, "filename", None) else ""
            return f"disk full{where} ({first}): {_FREE_SPACE}"
        if isinstance(link, RuntimeError) and "inline_container" in text:  # torch.save's writer, mid-file
            return f"torch could not write a checkpoint file ({first}), usually because the disk is full: {_FREE_SPACE}"
    for link in chain:
        if isinstance(link, OSError) and link.filename and link.errno is not None:
            return f"{link.filename}: {link.strerror or os.strerror(link.errno)}; check the path and its permissions"
    return None
