"""The per-phase timer: seconds per phase, overlapping phases of one name counted once."""

from __future__ import annotations

import pytest

from envloop.experience.phase_timer import TIMING_PHASES, PhaseTimer


def test_timing_phases_are_the_turn_steps_in_order():
    assert TIMING_PHASES == (
        "flatten", "generation", "gen_bookkeeping", "env_startup", "env_step",
        "rewards_and_status", "obs_tokenization",
    )  # fmt: skip


def test_a_phase_adds_to_the_seconds_its_name_holds():
    timer = PhaseTimer()
    timer.seconds["flatten"] = 10.0
    with timer.phase("flatten"):
        pass
    assert timer.seconds["flatten"] >= 10.0
    assert set(timer.seconds) == {"flatten"}


def test_a_phase_is_recorded_when_its_body_raises():
    timer = PhaseTimer()
    with pytest.raises(KeyError), timer.phase("env_step"):
        raise KeyError("boom")
    assert set(timer.seconds) == {"env_step"} and timer.seconds["env_step"] >= 0.0
