"""Third-party noise dropped at its source (`specprefill.quiet`), nothing else from the same loggers."""

import logging
import os

from specprefill import quiet


def _shown(name: str, text: str) -> bool:
    record = logging.LogRecord(name, logging.WARNING, __file__, 1, text, None, None)
    return logging.getLogger(name).filter(record)


def test_each_noise_is_dropped_and_the_rest_of_its_logger_kept(monkeypatch):
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    quiet.install()
    quiet.install()  # idempotent: one filter per logger
    for name, text in quiet.NOISE:
        assert not _shown(name, f"... {text} ...")
        assert _shown(name, "something else this logger says")
        assert sum(isinstance(f, quiet._Drop) for f in logging.getLogger(name).filters) == 1
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    try:
        quiet.install(debug=True)
        assert all(_shown(name, text) for name, text in quiet.NOISE)
        assert os.environ["TORCH_CPP_LOG_LEVEL"] == "WARNING"
    finally:
        quiet.install()


def test_a_level_of_the_users_own_is_kept(monkeypatch):
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    quiet.install()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"
