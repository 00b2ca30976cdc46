"""Deeper synthetic pipelines built from a shipped profile, for planning at scale (benchmarks, tests).

:func:`deepened` keeps the first and last stage (embedding, LM head) and fills
the middle by cycling the source's middle stages in order, so a 16- or 32-stage
profile has the same per-stage mix of times and energies as the measured
8-stage one. :func:`repeated` instead repeats the whole source pipeline, so
its first and last stages (embedding, LM head) also sit inside the pipeline:
a shape the planner's benchmarks were never tuned on. Pure: no I/O, the
source is not changed.
"""

from __future__ import annotations

from megatron_envpipe.core.profile import Profile, ProfileError
from megatron_envpipe.core.vocabulary import INSTRUCTIONS

MAX_SYNTHETIC_STAGES = 1024


def deepened(profile: Profile, num_stages: int) -> Profile:
    """``profile`` stretched to ``num_stages`` stages: first and last kept, middle stages cycled.

    New stage ``i`` (``0 < i < P-1``) takes source stage ``1 + (i-1) mod (P0-2)``
    (``P0`` = the source's stages; a 1- or 2-stage source repeats its stage 0).
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise ProfileError(f"num_stages must be an integer, got {num_stages!r}")
    if not 2 <= num_stages <= MAX_SYNTHETIC_STAGES:
        raise ProfileError(f"num_stages must be in 2..{MAX_SYNTHETIC_STAGES}, got {num_stages}")
    src = profile.num_stages
    if src < 3:
        middle = [0]
    else:
        middle = list(range(1, src - 1))
    keep = [0] + [middle[(i - 1) % len(middle)] for i in range(1, num_stages - 1)] + [src - 1]
    return Profile(
        {(new, ins): profile.points(old, ins) for new, old in enumerate(keep) for ins in INSTRUCTIONS},
        source=f"{profile.source} (deepened to {num_stages} stages)",
    )


def repeated(profile: Profile, times: int) -> Profile:
    """``profile``'s whole pipeline ``times`` times in a row: new stage ``i`` is source stage ``i mod P0``.

    Every chunk of a profile with model chunks is kept. The source's first and last stages
    recur inside the pipeline (at ``k * P0`` and ``k * P0 - 1``).
    """
    if isinstance(times, bool) or not isinstance(times, int):
        raise ProfileError(f"repeated: times must be an integer, got {times!r}")
    src = profile.num_stages
    if times < 1 or src * times > MAX_SYNTHETIC_STAGES:
        raise ProfileError(
            f"repeated: times must be in 1..{MAX_SYNTHETIC_STAGES // src} for a {src}-stage profile "
            f"(at most {MAX_SYNTHETIC_STAGES} stages), got {times}"
        )
    return Profile(
        {
            (k * src + s, ins, chunk): profile.points(s, ins, chunk)
            for k in range(times)
            for s in range(src)
            for ins in INSTRUCTIONS
            for chunk in range(profile.num_chunks)
        },
        source=f"{profile.source} (repeated {times} times, {src * times} stages)",
    )
