"""The energy log's baseline measured again at the plan's GPU age (megatron/baseline_refresh.py, issue 33):
which iterations repeat it, that they never count as planned, and that the log and its summary then
compare with the newest baseline only."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.energy_report import Baseline, EnergyReport, summary_line
from megatron_envpipe.megatron.baseline_refresh import _FIRST_AFTER, BaselineRefresh


def _run(refresh: BaselineRefresh, planned_at: int, last: int, energies: dict[int, float]) -> list[int]:
    """Iterations planned_at..last; the repeat measured right after its last iteration with energies[generation]."""
    refresh.plan_started(planned_at)
    repeats = []
    for it in range(planned_at, last + 1):
        if refresh.due(it):
            repeats.append(it)
            if len([r for r in repeats if r >= it - refresh.iterations + 1]) == refresh.iterations:
                refresh.measured(energies.get(refresh.generation, 100.0), it)
    return repeats


def test_repeats_after_the_plan_ran_then_ever_further_apart_until_two_agree():
    refresh = BaselineRefresh(2)
    # Heating GPU: 100, 101.5, 102.3, 102.4 J: only the third and fourth agree within 0.5 %.
    repeats = _run(refresh, 18, 400, {1: 100.0, 2: 101.5, 3: 102.3, 4: 102.4})
    first = 18 + _FIRST_AFTER
    assert repeats[:2] == [first, first + 1]
    assert repeats[2:4] == [first + 2 + 2 * _FIRST_AFTER, first + 3 + 2 * _FIRST_AFTER]  # twice as far
    assert refresh.generation == 4 and refresh.done and len(repeats) == 8
    assert all(refresh.is_repeat(i) for i in repeats) and not refresh.is_repeat(first + 2)


def test_short_iterations_repeat_long_enough_to_read_the_counter():
    """Each iteration's energy is read off a ~100 ms counter at its edges: a repeat spans >= 5 s."""
    short = BaselineRefresh(2)
    short.plan_started(10, iteration_time_s=0.66)
    assert short.span == 8 and [i for i in range(10, 40) if short.due(i)] == list(range(18, 26))
    long = BaselineRefresh(2)
    long.plan_started(10, iteration_time_s=4.4)
    assert long.span == 2
    tiny = BaselineRefresh(2)
    tiny.plan_started(0, iteration_time_s=0.01)
    assert tiny.span == 16  # bounded


def test_no_repeat_without_a_measured_baseline_or_before_the_plan():
    assert _run(BaselineRefresh(0), 10, 200, {}) == []
    refresh = BaselineRefresh(2)
    assert not refresh.due(40)  # the plan has not started
    with pytest.raises(ValueError):
        BaselineRefresh(-1)


def test_an_unmeasured_repeat_stops_repeating_rather_than_spinning():
    refresh = BaselineRefresh(2)
    refresh.plan_started(0)
    assert [i for i in range(0, 200) if refresh.due(i)] == [_FIRST_AFTER, _FIRST_AFTER + 1]


def test_the_runtime_never_counts_a_repeat_as_planned(tmp_path):
    pytest.importorskip("torch", reason="the run-time's package imports torch")
    from megatron_envpipe.config import EnvPipeConfig
    from megatron_envpipe.gpu.startup import DeviceFacts
    from megatron_envpipe.megatron.runtime import EnvPipeRuntime

    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", scheduling="ours", reconfig="default",
                                      profile="a40/gpt3-175b"))
    rt.attach_device(DeviceFacts(backend="simulated", name="sim", driver_version="", clocks_mhz=(1740, 1650),
                                 control=True, energy=True, modelled=True))
    phases = []
    for _ in range(20):
        plan = rt.prepare(8, 12)
        phases.append(plan.phase)
        rt.finish(8, 12, None)
    planned_at = rt.planned_at
    repeat = [i for i, p in enumerate(phases) if p.startswith("baseline again")]
    assert repeat == [planned_at + _FIRST_AFTER, planned_at + _FIRST_AFTER + 1], phases
    for i in range(20):
        assert rt.is_planned_iteration(i) == (i >= planned_at and i not in repeat)
        assert rt.is_baseline_iteration(i) == (i < planned_at or i in repeat)


def test_the_summary_compares_with_the_newest_baseline_over_the_windows_after_it():
    def report(it: int, energy: float) -> EnergyReport:
        return EnergyReport(it, 1.0, energy, (energy,), None, True, 1.0, 0.15, None, 1)
    reports = [report(i, 80.0 if i <= 12 else 85.0) for i in range(9, 21)]
    later = Baseline(100.0, 1.0, 2, 1740, generation=1, last_iteration=12)
    assert "measured again up to iteration 12, at the plan's GPU age" in later.describe()
    line = summary_line([r for r in reports if r.first_iteration > later.last_iteration], later, True, 4)
    assert "iterations 13-20" in line and "energy -15.00%" in line
