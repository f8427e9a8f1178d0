"""Recognising and masking secrets.

One place knows what a secret looks like, so the run-spec validator (which refuses specs that carry one) and the
log redaction filter (which masks them in every log line) can never disagree. Besides token-shaped strings, any value
registered at run time with :func:`register_secret` (a bucket secret key has no recognisable shape) is masked.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

MASK = "***"

# Token shapes, each with a human name used in error messages.
TOKEN_PATTERNS: dict[str, re.Pattern[str]] = {
    "a Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"),
    "a Hugging Face S3 access key": re.compile(r"\bHFAK[A-Z0-9]{12,}\b"),
    "an AWS access key id": re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"),
    "a bearer token": re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"),
    "a private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "a credential assignment": re.compile(
        r"(?i)\b(?:aws_secret_access_key|secret_access_key|api[_-]?key|password|passwd|hf_token)"
        r"(?:=['\"]?|\s*[=:]\s*['\"])[^\s'\"]{8,}"
    ),
    "credentials in a URL": re.compile(r"://[^/\s:@]+:[^/\s@]+@"),
}

_registered: set[str] = set()
_lock = threading.Lock()
# Secrets shorter than this are not masked by value: masking "abc" everywhere would shred ordinary text.
_MIN_REGISTERED_LENGTH = 6


def find_secret(text: str) -> str | None:
    """Return the name of the first kind of secret found in `text`, or None."""
    for name, pattern in TOKEN_PATTERNS.items():
        if pattern.search(text):
            return name
    with _lock:
        registered = tuple(_registered)
    if any(value in text for value in registered):
        return "a registered secret"
    return None


def register_secret(value: str | None) -> None:
    """Mask `value` wherever it appears in logs from now on (no-op for empty or very short values)."""
    if value and len(value) >= _MIN_REGISTERED_LENGTH:
        with _lock:
            _registered.add(value)


def redact(text: str) -> str:
    """Mask registered secret values and token-shaped strings in `text`."""
    with _lock:
        registered = sorted(_registered, key=len, reverse=True)
    for value in registered:
        text = text.replace(value, MASK)
    for pattern in TOKEN_PATTERNS.values():
        text = pattern.sub(_mask_match, text)
    return text


def _mask_match(match: re.Match[str]) -> str:
    found = match.group(0)
    # Keep the recognisable head ("hf_", "Bearer ", "password=") so a reader knows what was there.
    for head in ("hf_", "HFAK", "AKIA", "ASIA"):
        if found.startswith(head):
            return head + MASK
    separator = re.search(r"[=:]\s*['\"]?|\s+", found)
    if separator and not found.startswith("://"):
        return found[: separator.end()] + MASK
    if found.startswith("://"):
        return "://" + MASK + "@"
    return MASK


class _RedactingRecordFactory:
    """Wraps the log record factory so every record, from every logger, is redacted when it is created."""

    def __init__(self, inner: Callable[..., logging.LogRecord]):
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.inner(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed %-format must not kill logging; keep the raw message
            message = str(record.msg)
        record.msg, record.args = redact(message), ()
        if record.exc_info and record.exc_info[0] is not None:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return record


def install_log_redaction() -> None:
    """Redact every log record this process creates. Idempotent; every entry point calls it first."""
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _RedactingRecordFactory):
        logging.setLogRecordFactory(_RedactingRecordFactory(factory))
