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
        drops = [f.text for f in logging.getLogger(name).filters if isinstance(f, quiet._Drop)]
        assert drops == [t for n, t in quiet.NOISE if n == name]  # once each, however often installed
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    try:
        quiet.install(debug=True)
        assert all(_shown(name, text) for name, text in quiet.NOISE)
        assert os.environ["TORCH_CPP_LOG_LEVEL"] == "WARNING"
    finally:
        quiet.install()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"  # debug and back: quiet again (it was this process's value)


def test_warnings_are_ignored_here_and_in_child_processes(monkeypatch):
    import warnings

    monkeypatch.setenv("PYTHONWARNINGS", "error::DeprecationWarning")
    quiet.install()
    assert os.environ["PYTHONWARNINGS"].split(",")[-1] == "error::DeprecationWarning"  # the user's, last: it wins
    text, category = quiet.WARNINGS[0]
    assert category == "FutureWarning"
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn(f"{text}, use something else", FutureWarning, stacklevel=1)
    assert seen == []
    quiet.install(debug=True)
    assert os.environ["PYTHONWARNINGS"] == "error::DeprecationWarning"
    quiet.install()


def test_a_level_of_the_users_own_is_kept(monkeypatch):
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    quiet.install()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"
    quiet.install(debug=True)
    quiet.install()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"
