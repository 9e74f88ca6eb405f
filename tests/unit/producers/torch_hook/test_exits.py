"""Exit reports on the rank side: an unhandled exception, a fault file for fatal signals."""

from __future__ import annotations

import faulthandler
import sys
from pathlib import Path

import pytest

from producers.torch_hook.exits import ExitReporter


@pytest.fixture
def no_faulthandler():
    """pytest enables faulthandler for itself; the hook only takes one nobody enabled."""
    was = faulthandler.is_enabled()
    faulthandler.disable()
    yield
    if was:
        faulthandler.enable(file=sys.__stderr__)


def test_an_unhandled_exception_is_reported_and_the_previous_hook_still_runs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[0]))
    ex = ExitReporter(tmp_path / "agent.sock")
    ex.install()
    try:
        def step() -> None:
            raise ZeroDivisionError("division by zero")
        try:
            step()
        except ZeroDivisionError:
            sys.excepthook(*sys.exc_info())
        assert ex.report is not None and ex.report["exit"] == "exception"
        assert ex.report["detail"] == "ZeroDivisionError: division by zero"
        assert ex.report["stack"][-1].startswith("test_exits.py:") and (
            ex.report["stack"][-1].endswith(" in step"))
        assert seen == [ZeroDivisionError]  # the script's own excepthook ran too
        sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
        assert ex.report["exit"] == "exception"  # Ctrl-C is a stop: it replaced nothing
    finally:
        ex.uninstall()
    assert sys.excepthook is not ex._on_exception


def test_a_fault_file_is_kept_next_to_the_socket_and_removed_on_uninstall(
        tmp_path: Path, no_faulthandler: None) -> None:
    ex = ExitReporter(tmp_path / "agent.sock")
    ex.install()
    assert faulthandler.is_enabled() and Path(ex.fault_file).parent == tmp_path
    ex.uninstall()
    assert not faulthandler.is_enabled() and not list(tmp_path.iterdir())


def test_a_faulthandler_the_script_enabled_is_left_alone(tmp_path: Path) -> None:
    assert faulthandler.is_enabled()  # pytest's
    ex = ExitReporter(tmp_path / "agent.sock")
    ex.install()
    assert ex.fault_file == "" and not list(tmp_path.iterdir())
    ex.uninstall()
    assert faulthandler.is_enabled()
