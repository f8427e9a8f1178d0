"""Log redaction: registered values and token-shaped strings never reach a log line."""

from __future__ import annotations

import logging

import pytest

from jobs import secrets
from jobs.secrets import find_secret, install_log_redaction, redact, register_secret


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Start each test with no registered values: the registry is process-wide, and another test in this worker
    (the vault's) may have registered the very key quoted here, which would mask it whole."""
    monkeypatch.setattr(secrets, "_registered", set())


@pytest.fixture
def captured(caplog):
    install_log_redaction()
    caplog.set_level(logging.INFO)
    return caplog


def test_token_shapes_are_masked():
    text = (
        "token hf_abcdefghijklmnopqrstuvwxyz0123 key AKIAIOSFODNN7EXAMPLE "
        "header Authorization: Bearer abc.def.ghi-jkl url https://u:pw123456@host/x password=hunter2222"
    )
    masked = redact(text)
    for secret in (
        "hf_abcdefghijklmnopqrstuvwxyz0123",
        "AKIAIOSFODNN7EXAMPLE",
        "abc.def.ghi-jkl",
        "pw123456",
        "hunter2222",
    ):
        assert secret not in masked
    assert "hf_***" in masked and "AKIA***" in masked and "Bearer ***" in masked


def test_registered_values_are_masked_even_without_a_shape(captured):
    register_secret("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    logging.getLogger("any.module").info("secret is %s", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    assert "wJalrXUtnFEMI" not in captured.text
    assert "secret is ***" in captured.text


def test_every_logger_and_exception_text_is_redacted(captured):
    register_secret("registered-value-xyz")
    try:
        raise RuntimeError("failed with registered-value-xyz and hf_zzzzzzzzzzzzzzzzzzzzzzzzzz")
    except RuntimeError:
        logging.getLogger("deep.child.logger").exception("boom %s", "hf_yyyyyyyyyyyyyyyyyyyyyyyyyy")
    text = captured.text + "".join(record.exc_text or "" for record in captured.records)
    assert "registered-value-xyz" not in text
    assert "hf_zzzz" not in text and "hf_yyyy" not in text
    assert "RuntimeError" in text


def test_short_values_are_not_registered():
    register_secret("ab")
    assert redact("ab cd ab") == "ab cd ab"


def test_ordinary_text_is_left_alone():
    text = "step 12 reward 0.42 loaded trl-policy-v3 from runs/x/adapters/v000003"
    assert redact(text) == text
    assert find_secret(text) is None


def test_install_is_idempotent(captured):
    install_log_redaction()
    install_log_redaction()
    logging.getLogger("x").info("hf_abcdefghijklmnopqrstuvwxyz0123")
    assert captured.records[-1].getMessage() == "hf_***"
