"""The length model a simulated GPU costs its units with (variable-length micro-batches, issue 25).

A simulated GPU scales each unit's profile row to its micro-batch's size by a
:class:`~megatron_envpipe.core.length_costs.LengthCostModel`: fitted from the profile's own rows when
it was measured at >= 2 sizes (the start-up profiler's cached profiles are), else the documented
flop-count model of the shipped profile it simulates (an assumption, docs/variable-lengths.md).
"""

from __future__ import annotations

from megatron_envpipe.core.length_costs import (
    LengthCostError,
    LengthCostModel,
    default_length_model_for,
    fit_length_costs,
)
from megatron_envpipe.core.profile import Profile


def simulated_length_model(profile: Profile, source: str, num_stages: int | None = None) -> LengthCostModel | None:
    """The model for a simulated GPU of ``profile`` (read from ``source``) emulating ``num_stages``
    stages (``Profile.for_pipeline``: the first P-1 and the last): the profile's fit when it has sized
    rows, else ``default_length_model_for(source)``, else None (sized units are then refused)."""
    if profile.length_samples:
        model = fit_length_costs(profile.size_samples(), profile.reference_size, source=f"{source} (length fit)")
        if num_stages is None or num_stages == profile.num_stages:
            return model
        # The stages for_pipeline keeps, renumbered as it renumbers their rows.
        keep = [*range(num_stages - 1), profile.num_stages - 1]
        new_of = {old: new for new, old in enumerate(keep)}
        costs = {(new_of[s], c, ins, f): cost for (s, c, ins, f), cost in model.costs.items() if s in new_of}
        return LengthCostModel(model.reference, costs, model.default, model.source)
    try:
        return default_length_model_for(source)
    except LengthCostError:
        return None  # a custom profile measured at one size: no model to scale with
