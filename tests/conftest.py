"""Shared fixtures (the shipped real A40 profiles) and the test tiers (torchrun for tests: tests/launching.py).

Tiers (docs/testing.md): a test that launches processes carries ``dist``, ``e2e``, ``cli`` or ``slurm``
(an in-process one that takes seconds ``slow``); ``--fast`` runs the rest. Heavy files mark themselves
(``pytestmark``); the hooks of tests/tiering.py mark, from their code, the tests that launch something
and carry no tier marker, and add ``--fast``.
"""

from __future__ import annotations

import os
import sys

import pytest
from tiering import pytest_addoption, pytest_collection_modifyitems, pytest_configure  # noqa: F401  (hooks)

from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile

# One intra-op thread for torch (OpenMP, BLAS) in pytest and every process it starts, as the harness's and
# torchrun's ranks already run: on a small shared machine a second thread for tiny models costs CPU and wall
# time (spin-waits, contention; tests/megatron/test_gpu_check_profile_replay.py: 19 -> 7 CPU-s, 20 -> 9 s),
# and in-process results no longer depend on the core count. Set before any test module imports torch
# (nothing above does); an explicit OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def gpt3_profile() -> Profile:
    return Profile.from_csv(shipped_profile("a40/gpt3-175b"))


@pytest.fixture(scope="session")
def bloom_profile() -> Profile:
    return Profile.from_csv(shipped_profile("a40/bloom-176b"))


@pytest.fixture(autouse=True)
def _idle_clock_guards_end_with_their_test():
    """A clock guard a test made and left open (training code makes the process-wide default one, kept for
    the process's life) would keep its SIGINT/SIGTERM handlers in pytest for the rest of the session, and a
    SIGINT a later test raises would release it. Closed when the test is done, if it holds no lock (one that
    does is its test's business); guards made before the test (by wider fixtures) are left alone."""
    safety = sys.modules.get("megatron_envpipe.gpu.control.safety")
    before = {id(guard) for guard in safety._GUARDS} if safety is not None else set()
    yield
    safety = sys.modules.get("megatron_envpipe.gpu.control.safety")
    if safety is None:  # no test so far imported it: no guard exists
        return
    for guard in list(safety._GUARDS):
        if id(guard) not in before and not guard.locked_devices():
            guard.close()
