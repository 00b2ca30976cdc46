"""Shared fixtures: the shipped real A40 profiles."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile


@pytest.fixture(scope="session")
def gpt3_profile() -> Profile:
    return Profile.from_csv(shipped_profile("a40/gpt3-175b"))


@pytest.fixture(scope="session")
def bloom_profile() -> Profile:
    return Profile.from_csv(shipped_profile("a40/bloom-176b"))
