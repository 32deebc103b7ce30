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
