"""ferry's log records reach Python's logging, logger "ferry", with their levels; forward_logs(False)
sends them to stderr instead."""

import logging
import subprocess
import sys
import textwrap

import pytest

import ferry


def refused_join():
    """The coordinator warns when it refuses a connection: a trainer with the wrong token."""
    with ferry.Trainer(token="right") as trainer:
        with pytest.raises(ferry.Error) as e:
            ferry.Trainer(coordinator=trainer.coordinator_address, token="wrong")
        assert e.value.code == "Unauthenticated"
    assert ferry.flush_logs()


def test_a_warning_reaches_the_ferry_logger(caplog):
    assert ferry.log_forwarding()  # the default
    caplog.set_level(logging.WARNING, logger="ferry")
    refused_join()
    records = [r for r in caplog.records if r.name == "ferry" and "refused" in r.getMessage()]
    assert records, [r.getMessage() for r in caplog.records]
    assert records[0].levelno == logging.WARNING
    assert "answered the token challenge wrongly" in records[0].getMessage()


def test_the_ferry_logger_level_filters(caplog):
    caplog.set_level(logging.ERROR, logger="ferry")
    refused_join()
    assert not [r for r in caplog.records if r.name == "ferry" and "refused" in r.getMessage()]


def test_forwarding_off_writes_stderr(caplog):
    caplog.set_level(logging.DEBUG, logger="ferry")
    ferry.forward_logs(False)
    try:
        assert not ferry.log_forwarding()
        # The C++ library writes stderr itself; run it in a child to read that.
        code = textwrap.dedent("""
            import ferry
            ferry.forward_logs(False)
            with ferry.Trainer(token="right") as t:
                try:
                    ferry.Trainer(coordinator=t.coordinator_address, token="wrong")
                except ferry.Error:
                    pass
        """)
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr
        assert "[ferry] [warning] refused" in child.stderr
        refused_join()
        assert not [r for r in caplog.records if r.name == "ferry"]
    finally:
        ferry.forward_logs(True)
    assert ferry.log_forwarding()
    refused_join()
    assert [r for r in caplog.records if r.name == "ferry" and "refused" in r.getMessage()]


def test_records_from_ferry_threads_at_exit_do_not_crash():
    """Records made while the interpreter exits (workers closed by the atexit hook) reach stderr
    or logging, and the exit is clean."""
    code = textwrap.dedent("""
        import logging, sys
        import ferry
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        import os
        os.environ["FERRY_LOG_LEVEL"] = "info"
        t = ferry.Trainer(log_level="info")
        ferry.flush_logs()
        print("done", flush=True)
        # t is left open: it stops while the interpreter exits
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert "done" in child.stdout
    assert "ferry INFO coordinator listening on" in child.stdout, child.stdout
