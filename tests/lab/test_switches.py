"""Mechanism switches exist only inside `phalanx lab`: anywhere else, switching one off is refused."""

import os

import pytest

from phalanx.core.errors import ConfigError
from phalanx.lab.jobs import collective_timeout_for, detector_for
from phalanx.lab.switches import LAB_ENV, NEVER_S, LabSwitches, in_lab_session, lab_session, off


def test_switching_a_mechanism_off_outside_a_lab_session_is_refused():
    with pytest.raises(ConfigError, match="only be turned off inside `phalanx lab`"):
        LabSwitches(deadlines=False)


def test_setting_the_environment_variable_by_hand_does_not_open_a_session(monkeypatch):
    monkeypatch.setenv(LAB_ENV, "guessed")
    assert not in_lab_session()
    with pytest.raises(ConfigError):
        LabSwitches(authentication=False)


def test_inside_a_lab_session_switches_turn_off_and_the_session_closes_after():
    with lab_session():
        sw = off("deadlines", "adaptive_shares")
        assert sw.off() == ["deadlines", "adaptive_shares"]
        assert "deadlines OFF" in sw.describe()
    assert not in_lab_session()
    assert LAB_ENV not in os.environ
    with pytest.raises(ConfigError):
        LabSwitches(adaptive_shares=False)


def test_all_on_is_allowed_anywhere():
    assert LabSwitches().off() == []


def test_unknown_switch_is_refused_with_the_known_names():
    with lab_session(), pytest.raises(ConfigError, match="known"):
        off("fencing_but_misspelt")


def test_switches_map_to_existing_configuration():
    base = detector_for(LabSwitches())
    with lab_session():
        no_deadlines = detector_for(off("deadlines"))
        no_progress = detector_for(off("progress_detector"))
        assert collective_timeout_for(off("collective_deadline")) == NEVER_S
    assert no_deadlines.heartbeat_timeout_s == NEVER_S and no_deadlines.progress_timeout_s == NEVER_S
    assert no_progress.progress_timeout_s == NEVER_S
    assert no_progress.heartbeat_timeout_s == base.heartbeat_timeout_s
    assert collective_timeout_for(LabSwitches()) == 5.0


def test_a_job_refuses_a_switch_it_cannot_act_on_instead_of_ignoring_it():
    from phalanx.lab.jobs import run_sim

    with lab_session(), pytest.raises(ConfigError, match="cannot switch off authentication"):
        run_sim(2, 2, sw=off("authentication"))


def test_mode_switches_turn_the_requested_mode_into_strict():
    from phalanx.core.modes import ConsistencyMode, ModeConfig
    from phalanx.lab.jobs import modes_for

    available = ModeConfig(mode=ConsistencyMode.AVAILABLE)
    assert modes_for(LabSwitches(), available).mode is ConsistencyMode.AVAILABLE
    with lab_session():
        assert modes_for(off("adaptive_shares"), available).mode is ConsistencyMode.STRICT
        assert modes_for(off("infrequent_sync"), ModeConfig(mode=ConsistencyMode.LOCAL_SGD)).mode \
            is ConsistencyMode.STRICT
