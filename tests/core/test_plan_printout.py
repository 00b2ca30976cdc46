"""EnvPipe's plan printout shows real receive waits, or none: never invented zeros."""

from __future__ import annotations

import logging
import re

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.core.gpu_specs import get_gpu_spec
from megatron_envpipe.core.plan import format_envpipe
from megatron_envpipe.core.profile import Profile
from megatron_envpipe.core.resources import shipped_profile
from megatron_envpipe.megatron.runtime import EnvPipeRuntime
from megatron_envpipe.planning.basis import PlannerConfig
from megatron_envpipe.planning.planner import plan_envpipe


def _result():
    profile = Profile.from_csv(shipped_profile("a40/gpt3-175b"))
    return plan_envpipe(profile, 12, PlannerConfig(gpu=get_gpu_spec("a40")))


def test_waits_come_from_the_timeline():
    result = _result()
    waits = result.timeline.recv_wait_ms_rows()
    text = format_envpipe(result.plan, waits, result.timeline.critical_units())
    printed = [float(x) for x in re.findall(r"[FB]\d+ \d+ ([\d.]+)", text)]
    assert len(printed) == sum(map(len, waits)) and max(printed) > 0.0
    assert printed == [round(w, 1) for row in waits for w in row]


def test_without_waits_none_are_printed():
    result = _result()
    text = format_envpipe(result.plan)
    first = text.splitlines()[0]
    assert re.match(r"Stage 0 \| +F0 \d+ +F1 \d+ ", first), first
    assert " 0.0" not in text


def test_training_log_prints_predicted_waits(caplog):
    rt = EnvPipeRuntime(EnvPipeConfig(plan_type="envelope", scheduling="ours", profile="a40/gpt3-175b", gpu="a40"))
    with caplog.at_level(logging.INFO, logger="megatron_envpipe"):
        rt.prepare(8, 12)
    table = caplog.text.split("EnvPipe plan (unit, SM clock MHz, predicted receive wait ms", 1)[1]
    waits = [float(x) for x in re.findall(r"[FB]\d+ \d+ ([\d.]+)", table)]
    assert len(waits) == 8 * 24 and max(waits) > 0.0
