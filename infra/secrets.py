"""Secrets stay out of configs, logs and MLflow: they come from the environment (or a file the environment
names), recipes refuse them, and anything logged is redacted on the way out."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# a secret-looking word in a key, delimited by start/end or _ - . (so `auth_token` and `MLFLOW_TRACKING_PASSWORD`
# match, `shard_tokens`, `max_new_tokens` and `tokenizer` do not)
SECRET_NAME = re.compile(
    r"(^|[_.-])(pass(word|wd|phrase)?|secrets?|token|api[_-]?key|access[_-]?key|private[_-]?key|"
    r"auth[_-]?string|credentials?)($|[_.-])",
    re.I,
)
REDACTED = "***"


def url_has_password(value: str) -> bool:
    try:
        return bool(urlsplit(value).password)
    except ValueError:
        return False


def strip_credentials(value: str) -> str:
    """`scheme://user:pass@host/...` -> `scheme://user:***@host/...`; other strings unchanged."""
    if not url_has_password(value):
        return value
    parts = urlsplit(value)
    netloc = f"{parts.username}:{REDACTED}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redact(values: dict[str, Any]) -> dict[str, Any]:
    """A copy with values under secret-looking keys masked and URL passwords stripped."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if SECRET_NAME.search(str(key).rsplit(".", 1)[-1]) and value not in (None, "", False):
            out[key] = REDACTED
        elif isinstance(value, str):
            out[key] = strip_credentials(value)
        else:
            out[key] = value
    return out


def from_env(name: str) -> str | None:
    """`$NAME`, or the contents of the file `$NAME_FILE` (Docker/Kubernetes secrets), else None."""
    if os.environ.get(name):
        return os.environ[name]
    path = os.environ.get(f"{name}_FILE")
    return Path(path).read_text().strip() if path else None
