"""gpu-check's measurement columns in a profile (reached_mhz, reached_spread_mhz, time_rel_unc, energy_rel_unc):
parsed and ranged, refused naming the line (issue 39, 'physical plausibility')."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.profile import Profile, ProfileError

HEADER = "stage,instruction,frequency,time,energy,reached_mhz,reached_spread_mhz,time_rel_unc,energy_rel_unc\n"


def _text(fwd: str = "1410,15,0.01,0.02", bwd: str = "1410,15,0.01,0.02") -> str:
    return (HEADER + f"0,forward,1410,0.01,2.0,{fwd}\n0,backward,1410,0.02,4.0,{bwd}\n"
            + "0,forward,1200,0.012,1.8,1200,15,0.01,0.02\n0,backward,1200,0.024,3.6,1200,15,0.01,0.02\n")


def test_a_gpu_check_profile_reads():
    assert Profile.from_csv_text(_text(), "p.csv").num_stages == 1
    assert Profile.from_csv_text(_text(fwd=",,,"), "p.csv").num_stages == 1  # not measured: empty cells


@pytest.mark.parametrize("column, value", [
    (0, "abc"), (0, "nan"), (0, "-inf"), (0, "1e400"), (0, "700"), (0, "3000"), (0, "1410.5"),
    (1, "-1"), (1, "x"), (2, "nan"), (2, "-0.1"), (2, "inf"), (3, "abc"), (3, "1e9"),
])
def test_a_bad_measurement_cell_is_refused_naming_the_line(column, value):
    cells = "1410,15,0.01,0.02".split(",")
    cells[column] = value
    with pytest.raises(ProfileError) as info:
        Profile.from_csv_text(_text(fwd=",".join(cells)), "p.csv")
    message = str(info.value)
    names = ("reached_mhz", "reached_spread_mhz", "time_rel_unc", "energy_rel_unc")
    assert message.startswith("p.csv:2:") and names[column] in message and "\n" not in message, message


def test_a_reached_clock_near_its_request_is_accepted():
    assert Profile.from_csv_text(_text(fwd="1395,30,0.01,0.02"), "p.csv").num_stages == 1
