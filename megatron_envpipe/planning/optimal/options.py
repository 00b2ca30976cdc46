"""Per-unit clock options: the clocks worth choosing for one (stage, instruction), and their convex hull."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_envpipe.core.profile import ProfilePoint, pareto_filter


@dataclass(frozen=True)
class ClockOption:
    """One clock of one (stage, instruction): time, energy and effective energy."""

    freq_mhz: int
    time_s: float
    energy_j: float
    cost_j: float  # energy - P_p2p * time


def clock_options(
    points: Sequence[ProfilePoint], p2p_power_w: float, allowed_mhz: Sequence[int] | None = None
) -> tuple[ClockOption, ...]:
    """Options worth choosing, fastest first: strictly cheaper (effective energy) as they get slower.

    The list ends at the cheapest clock; slower clocks past it cost more and
    save nothing. Ties in time keep the cheaper clock (then the faster one).
    """
    keep = None if allowed_mhz is None else set(allowed_mhz)
    opts = (
        ClockOption(p.freq_mhz, p.time_s, p.energy_j, p.energy_j - p2p_power_w * p.time_s)
        for p in points
        if keep is None or p.freq_mhz in keep
    )
    return tuple(pareto_filter(opts, key=lambda o: (o.time_s, o.cost_j, -o.freq_mhz), cost=lambda o: o.cost_j))


def lower_hull(options: Sequence[ClockOption]) -> tuple[int, ...]:
    """Indices (fastest first) of the options on the lower convex hull of (time, cost)."""
    hull: list[int] = []
    for i, o in enumerate(options):
        while len(hull) >= 2:
            a, b = options[hull[-2]], options[hull[-1]]
            cross = (b.time_s - a.time_s) * (o.cost_j - a.cost_j) - (b.cost_j - a.cost_j) * (o.time_s - a.time_s)
            if cross <= 0:  # b lies on or above the segment a-o
                hull.pop()
            else:
                break
        hull.append(i)
    return tuple(hull)
