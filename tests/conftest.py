"""Shared fixtures (the shipped real A40 profiles) and the test tiers (torchrun for tests: tests/launching.py).

Tiers (docs/testing.md): a test that launches processes carries ``dist``, ``e2e``, ``cli`` or ``slurm``
(an in-process one that takes seconds ``slow``); ``--fast`` runs the rest. Heavy files mark themselves
(``pytestmark``); the hooks of tests/tiering.py mark, from their code, the tests that launch something
and carry no tier marker, and add ``--fast``.
"""

from __future__ import annotations

import pytest
from tiering import pytest_addoption, pytest_collection_modifyitems, pytest_configure  # noqa: F401  (hooks)

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile


@pytest.fixture(scope="session")
def gpt3_profile() -> Profile:
    return Profile.from_csv(shipped_profile("a40/gpt3-175b"))


@pytest.fixture(scope="session")
def bloom_profile() -> Profile:
    return Profile.from_csv(shipped_profile("a40/bloom-176b"))
