"""A profile's optional measurement columns (written by ``envpipe gpu-check`` step 5), parsed and ranged.

``reached_mhz`` is the clock the SMs actually ran at (median NVML reading during the row's windows),
``reached_spread_mhz`` its spread, ``time_rel_unc``/``energy_rel_unc`` the row's relative uncertainties.
Planners do not use them, but a row that states them states how it was measured: ``abc``, ``nan``,
``-inf`` or a clock the GPU never ran at (``reached_mhz`` far from the row's ``frequency``) mean the
row is not a measurement at its clock, so the file is refused naming the line. Rows whose clock was
not reached are never written by gpu-check (docs/gpu-probe.md). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from megatron_envpipe.core.file_numbers import cell_number
from megatron_envpipe.core.flag_ranges import FlagRange

__all__ = ["MEASUREMENT_COLUMNS", "check_measurement_cells"]

MEASUREMENT_COLUMNS = ("reached_mhz", "reached_spread_mhz", "time_rel_unc", "energy_rel_unc")
# gpu-check counts a clock reached within max(30 MHz, 2 profile steps) of the request; a quarter of the
# clock away is beyond any step it takes: that row ran at another clock than it says.
_MAX_REACHED_GAP = 0.25
_MHZ = FlagRange("int", 1, 100_000, "MHz", "above any GPU's clock")
_RANGES = {
    "reached_mhz": _MHZ,
    "reached_spread_mhz": FlagRange("int", 0, 100_000, "MHz", "above any GPU's clock"),
    # The backward's uncertainty is a difference's (pair - forward): it may exceed 1, never by this much.
    "time_rel_unc": FlagRange("float", 0.0, 1_000.0, "", "an uncertainty 1000x the value is no measurement"),
    "energy_rel_unc": FlagRange("float", 0.0, 1_000.0, "", "an uncertainty 1000x the value is no measurement"),
}


def check_measurement_cells(row: Mapping[str, str], freq_mhz: int, where: str,
                            error: Callable[[str], Exception]) -> None:
    """Each measurement column the row has is empty (not measured) or a number in range; ``reached_mhz``
    lies within :data:`_MAX_REACHED_GAP` of ``freq_mhz``. ``where`` is ``file:line``."""
    for column in MEASUREMENT_COLUMNS:
        cell = row.get(column, "").strip()
        if not cell:
            continue
        value = cell_number(cell, _RANGES[column], f"{where}: {column}", error)
        if column == "reached_mhz" and abs(value - freq_mhz) > _MAX_REACHED_GAP * freq_mhz:
            raise error(f"{where}: reached_mhz {cell} is far from the row's frequency {freq_mhz} MHz (more than "
                        f"{100 * _MAX_REACHED_GAP:g} %): the row was not measured at its clock; measure it again "
                        "or remove the row")
