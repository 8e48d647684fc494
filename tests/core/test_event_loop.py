"""core/event_loop.py: which loop phalanx's own processes run on, and a broken setting's error."""

from __future__ import annotations

import asyncio

import pytest

from phalanx.core import event_loop
from phalanx.core.errors import ConfigError


def test_asyncio_is_forced_by_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_EVENT_LOOP", "asyncio")
    loop = event_loop.new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


def test_auto_is_uvloop_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.delenv("PHALANX_EVENT_LOOP", raising=False)
    assert event_loop.loop_factory() is uvloop.new_event_loop

    async def main() -> str:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    assert event_loop.run(main()).startswith("uvloop")


def test_an_unknown_setting_names_the_variable_and_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_EVENT_LOOP", "trio")
    with pytest.raises(ConfigError, match=r"PHALANX_EVENT_LOOP='trio'.*auto, uvloop, asyncio"):
        event_loop.loop_factory()
