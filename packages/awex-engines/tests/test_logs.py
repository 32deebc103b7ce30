"""Awex's log lines where nobody set logging up (a Ray actor, an engine's worker, a bare script): importing
awex.engines prints them on standard error at AWEX_LOGGING_LEVEL; an application's own setup and NONE are left
alone; nothing is printed twice."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from awex.engines import logs


def test_importing_awex_engines_shows_info_lines_where_logging_is_not_set_up():
    code = "import logging, awex.engines; logging.getLogger('awex.engines.x').info('hello-awex')"
    env = {k: v for k, v in os.environ.items() if k != logs.ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("hello-awex") == 1 and "awex.engines.x INFO hello-awex" in out.stderr, out.stderr


@pytest.fixture
def bare(monkeypatch):
    """awex's logger as a fresh process has it (no handler), restored after."""
    awex = logging.getLogger("awex")
    kept = (awex.handlers[:], awex.level, awex.propagate)
    awex.handlers[:] = []
    monkeypatch.delenv(logs.ENV, raising=False)
    yield awex
    awex.handlers[:] = kept[0]
    awex.setLevel(kept[1])
    awex.propagate = kept[2]


def _configure(*root_handlers: logging.Handler):
    """:func:`logs.configure` with the root logger holding only ``root_handlers`` (pytest's own set aside)."""
    root = logging.getLogger()
    held = root.handlers[:]
    root.handlers[:] = list(root_handlers)
    try:
        return logs.configure()
    finally:
        root.handlers[:] = held


def test_the_level_is_the_users_and_none_leaves_logging_alone(bare, monkeypatch, capsys):
    monkeypatch.setenv(logs.ENV, "debug")
    assert _configure() is not None and bare.level == logging.DEBUG
    logging.getLogger("awex.transport").debug("debug-awex")
    assert "awex.transport DEBUG debug-awex" in capsys.readouterr().err
    assert _configure() is None and len(bare.handlers) == 1  # once
    bare.handlers[:] = []
    monkeypatch.setenv(logs.ENV, "NONE")
    assert _configure() is None and not bare.handlers
    monkeypatch.setenv(logs.ENV, "LOUD")
    assert _configure() is not None and bare.level == logging.INFO
    assert "AWEX_LOGGING_LEVEL='LOUD' is not one of" in capsys.readouterr().err


def test_an_application_that_set_logging_up_first_keeps_it(bare):
    assert _configure(logging.NullHandler()) is None and not bare.handlers and bare.propagate


def test_set_up_later_the_root_does_not_print_awex_lines_again(bare, capsys):
    assert _configure() is not None
    app = logging.StreamHandler(sys.stderr)  # the application's, added afterwards
    logging.getLogger().addHandler(app)
    try:
        logging.getLogger("awex.engines.x").warning("once-awex")
    finally:
        logging.getLogger().removeHandler(app)
    assert capsys.readouterr().err.count("once-awex") == 1
