"""Requests kept off a sync's critical path run in order, never raise into the caller, and can be waited for."""

import logging
import threading

from awex.engines.sync.background import Background


def test_calls_run_in_order_off_the_callers_thread_and_flush_waits_for_them():
    seen: list = []
    gate = threading.Event()
    bg = Background("test")
    bg.submit("first", lambda: (gate.wait(5), seen.append(("first", threading.current_thread().name))))
    bg.submit("second", seen.append, ("second", None))
    assert seen == []  # the caller did not wait for them
    gate.set()
    assert bg.flush(5)
    assert [s[0] for s in seen] == ["first", "second"]
    assert seen[0][1] == "awex-background-test"


def test_a_failing_call_is_logged_and_the_next_still_runs(caplog):
    seen: list = []
    bg = Background("test")

    def boom():
        raise RuntimeError("server gone")

    with caplog.at_level(logging.WARNING, logger="awex.engines"):
        bg.submit("report of version v1", boom)
        bg.submit("next", seen.append, 1)
        assert bg.flush(5)
    assert seen == [1]
    assert "report of version v1 failed" in caplog.text and "server gone" in caplog.text


def test_a_steady_versions_log_line_is_written_off_the_callers_thread_a_new_plans_at_once(caplog):
    gate = threading.Event()
    bg = Background("test")
    with caplog.at_level(logging.INFO, logger="awex.engines"):
        bg.submit("a report still being sent", gate.wait, 5)
        bg.log_line("trainer:0 sent v7: 10 bytes in 0.001 s", now=False)
        bg.log_line("trainer:0 sent v1: 10 bytes in 0.9 s (new plan: ...)", now=True)
        assert [r.getMessage() for r in caplog.records] == ["trainer:0 sent v1: 10 bytes in 0.9 s (new plan: ...)"]
        gate.set()
        assert bg.flush(5)
        assert [r.getMessage() for r in caplog.records][1:] == ["trainer:0 sent v7: 10 bytes in 0.001 s"]
        assert [r.threadName for r in caplog.records] == ["MainThread", "awex-background-test"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="awex.engines"):  # INFO off: nothing is handed over
        bg.log_line("not written", now=False)
        assert bg._queue.empty()
        assert bg.flush(5) and not caplog.records


def test_what_is_queued_still_goes_out_when_the_process_exits():
    """A steady version's log line (and the report before it) queued just before the process ends is not lost."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import logging, sys
        from awex.engines.sync.background import Background
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
        bg = Background("exit")
        bg.submit("a report", print, "reported", flush=True)
        bg.log_line("trainer:0 sent v9: 10 bytes in 0.001 s", now=False)
        bg.last_word("v8's record", lambda: print("v8 recorded", flush=True))
        bg.last_word("v9's record", lambda: print("v9 recorded", flush=True))  # replaces v8's
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["reported", "v9", "recorded"]  # what was queued, then the last word, once
    assert "trainer:0 sent v9: 10 bytes in 0.001 s" in out.stderr


def test_the_last_word_is_said_once_where_asked_and_only_the_latest():
    said: list[str] = []
    bg = Background("last")
    bg.last_word("first", lambda: said.append("first"))
    bg.last_word("second", lambda: said.append("second"))
    assert said == []  # kept, not run
    bg.say_last_word()
    bg.say_last_word()
    assert said == ["second"]
