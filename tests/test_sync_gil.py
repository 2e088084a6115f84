"""sync._gil_handoff: the short GIL switch interval holds only while a sync runs."""

import sys

import pytest

from skyrl_mega.weight_sync import sync


def test_switch_interval_is_short_during_a_sync_and_restored_after():
    before = sys.getswitchinterval()
    with sync._gil_handoff():
        assert sys.getswitchinterval() == pytest.approx(min(before, sync.GIL_SWITCH_S))
    assert sys.getswitchinterval() == before


def test_restored_when_the_sync_raises():
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError):
        with sync._gil_handoff():
            raise RuntimeError("sync failed")
    assert sys.getswitchinterval() == before


def test_none_leaves_the_interpreter_setting(monkeypatch):
    monkeypatch.setattr(sync, "GIL_SWITCH_S", None)
    before = sys.getswitchinterval()
    with sync._gil_handoff():
        assert sys.getswitchinterval() == before
