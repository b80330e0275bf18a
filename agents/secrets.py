"""Which strings are credentials, so that what leaves the process (spans, tracker tables, error texts) never holds one.

Rule: a credential is the value (8+ characters) of any environment variable whose name contains ``API_KEY``,
``SECRET``, ``TOKEN`` or ``PASSWORD`` (``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN``...), plus what a
caller names; :func:`redact` replaces each occurrence, longest first, by ``[redacted]``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

REDACTED = "[redacted]"
SECRET_NAME = re.compile(r"API_KEY|SECRET|TOKEN|PASSWORD", re.IGNORECASE)


def environment_secrets(env: Mapping[str, str] | None = None, also: Iterable[str] = ()) -> list[str]:
    """The credentials in `env` (default: os.environ) and `also`, longest first."""
    env = os.environ if env is None else env
    found = {v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 8} | {s for s in also if s}
    return sorted(found, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret and secret in text:
            text = text.replace(secret, REDACTED)
    return text
