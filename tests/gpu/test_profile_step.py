"""gpu-check step 5's measurement (megatron_envpipe.apps.gpu_check.stage_profile) against the simulated GPU on virtual time:
it must recover the profile that drives the device within the uncertainty it reports, through a stepped
(100 ms) energy counter, and leave out (never write under the wrong clock) rows whose clock was not reached."""

from __future__ import annotations

import pytest

from megatron_envpipe.apps.gpu_check.stage_profile import (
    ProfileRunError,
    identical_stages,
    measure_stage_profile,
    pick_clocks,
)
from megatron_envpipe.core.device_dynamics import DeviceDynamics
from megatron_envpipe.core.profile import Profile, ProfileError
from megatron_envpipe.core.schedule import Unit
from megatron_envpipe.core.virtual_clock import VirtualClock
from megatron_envpipe.gpu.control.safety import ClockGuard
from megatron_envpipe.gpu.devices.simulated import SimulatedGpu

PERIOD_S = 0.1


class NoKernels:
    """The simulated GPU charges the units; the host does nothing."""

    def __init__(self) -> None:
        self.units = 0

    def run(self, unit: Unit) -> None:
        self.units += 1

    def sync(self) -> None:
        pass

    def reset(self) -> None:
        pass


def _device(profile: Profile, **kw) -> tuple[SimulatedGpu, VirtualClock]:
    vc = VirtualClock()
    dyn = DeviceDynamics(counter_period_s=PERIOD_S, source="test: stepped counter")
    return SimulatedGpu(profile, 0, clock=vc.now, sleep=vc.sleep, dynamics=dyn,
                        blocking_power_w_at=lambda f: 40.0 + 0.02 * f, **kw), vc


def _measure(device, vc, clocks, tmp_path):
    guard = ClockGuard(tmp_path / "state", install_handlers=False)
    try:
        return measure_stage_profile(device, NoKernels(), clocks, lambda f: guard.lock(device, f),
                                     counter_period_s=PERIOD_S, window_s=0.4, repeats=2, clock=vc.now,
                                     sleep=vc.sleep)
    finally:
        guard.close()
        assert device.locked_clock_mhz() is None  # the guard reset the clock


def test_profile_recovers_the_device_within_its_uncertainty(gpt3_profile, tmp_path):
    device, vc = _device(gpt3_profile)
    clocks = pick_clocks(device.supported_clocks_mhz(), 4)
    result = _measure(device, vc, clocks, tmp_path)
    assert [r.freq_mhz for r in result.reached_rows] == list(clocks) and not result.not_reached
    for row in result.rows:
        assert row.reached_mhz == row.freq_mhz and row.reached_spread_mhz == 0
        # The idle windows measured the clock-dependent blocking power the device was given.
        assert row.idle_power_w == pytest.approx(40.0 + 0.02 * row.freq_mhz, rel=0.01)
        for ins, m in (("forward", row.forward), ("backward", row.backward)):
            truth_e = gpt3_profile.energy_j(0, ins, row.freq_mhz)
            assert m.time_s == pytest.approx(gpt3_profile.time_s(0, ins, row.freq_mhz), rel=1e-9)
            assert 0 < m.energy_rel_unc < 0.05
            # Within the reported uncertainty (the stepped counter's edges), not merely "close".
            assert abs(m.energy_j / truth_e - 1) <= m.energy_rel_unc, (row.freq_mhz, ins, m)
    text = result.to_csv_text()
    header = text.splitlines()[0].split(",")
    assert header[:5] == ["stage", "instruction", "frequency", "time", "energy"]
    assert header[5:] == ["reached_mhz", "reached_spread_mhz", "time_rel_unc", "energy_rel_unc"]
    back = Profile.from_csv_text(text, source="profile.csv")  # the planner reads the extra columns fine
    assert back.frequencies(0, "forward") == tuple(clocks)
    four = identical_stages(back, 4)
    assert four.num_stages == 4 and four.points(3, "backward") == back.points(0, "backward")


def test_a_clock_not_reached_is_left_out_and_named(gpt3_profile, tmp_path):
    # Power capping: the SMs stay at or below 1410 MHz whatever is locked (NVML still reports the lock).
    device, vc = _device(gpt3_profile, sm_clock_range_mhz=(600, 1410))
    clocks = (1740, 1410, 1200)
    result = _measure(device, vc, clocks, tmp_path)
    assert [(r.freq_mhz, r.reached_mhz, r.reached) for r in result.rows] == [
        (1740, 1410, False), (1410, 1410, True), (1200, 1200, True)]
    text = result.to_csv_text()
    assert ",1740," not in text  # never written under a clock it did not run at
    assert Profile.from_csv_text(text).frequencies(0, "forward") == (1410, 1200)


def test_pick_clocks_keeps_the_maximum_and_spreads_down_to_half():
    supported = tuple(range(1980, 200, -15))
    picks = pick_clocks(supported, 6)
    assert picks[0] == 1980 and len(picks) == 6 and min(picks) >= 990
    assert list(picks) == sorted(picks, reverse=True)
    assert pick_clocks(supported, 1) == (1980,)
    assert pick_clocks((1500, 1400), 5) == (1500, 1400)
    with pytest.raises(ProfileRunError, match="count >= 1"):
        pick_clocks(supported, 0)


def test_old_profiles_still_read_and_unknown_columns_still_refused():
    old = "stage,instruction,frequency,time,energy\n0,forward,1000,0.1,10\n0,backward,1000,0.2,20\n"
    assert Profile.from_csv_text(old).energy_j(0, "forward", 1000) == 10
    with pytest.raises(ProfileError, match="unknown column.*'reached'"):
        Profile.from_csv_text(old.replace("energy\n", "energy,reached\n").replace("10\n", "10,1\n")
                              .replace("20\n", "20,1\n"))
