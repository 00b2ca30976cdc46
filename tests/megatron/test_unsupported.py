"""What EnvPipe cannot run is said, never silently ignored.

* Start-up validation (``validate_with_megatron_args``): any setting other than
  Megatron's own (baseline/1f1b/default) is refused with a virtual pipeline
  (``--virtual-pipeline-model-parallel-size``, ``--num-layers-per-virtual-pipeline-stage``)
  and without pipeline parallelism (PP = 1): Megatron would never call the schedule
  EnvPipe replaces. Megatron's own setting stays accepted.
* ``install()``: when Megatron picks its interleaved schedule (virtual pipeline) or its
  no-pipelining one, that schedule runs unchanged and EnvPipe logs once why it is not
  running; ``uninstall()`` restores both.
"""

from __future__ import annotations

import argparse
import logging

import pytest

from megatron_envpipe.config import EnvPipeConfig, EnvPipeConfigError

NON_STOCK = [
    dict(plan_type="envelope"),  # envelope with Megatron's 1F1B order
    dict(plan_type="uniform"),
    dict(plan_type="optimal"),
    dict(plan_type="envelope", scheduling="ours", reconfig="balanced"),
    dict(scheduling="ours"),  # baseline clocks, EnvPipe's order
    dict(reconfig="balanced"),
]
VIRTUAL = [
    dict(virtual_pipeline_model_parallel_size=2),
    dict(num_layers_per_virtual_pipeline_stage=2),
]


def megatron(pp: int = 4, **kwargs) -> argparse.Namespace:
    values = dict(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
                  num_layers_per_virtual_pipeline_stage=None, micro_batch_size=1, global_batch_size=8,
                  data_parallel_size=1)
    return argparse.Namespace(**{**values, **kwargs})


def _flags(settings: dict) -> list[str]:
    names = {"plan_type": "--envpipe-type", "scheduling": "--envpipe-scheduling", "reconfig": "--envpipe-reconfig"}
    return [f"{names[k]} {v}" for k, v in settings.items()]


@pytest.mark.parametrize("settings", NON_STOCK, ids=lambda s: "+".join(s.values()))
@pytest.mark.parametrize("virtual", VIRTUAL, ids=lambda v: next(iter(v)))
def test_virtual_pipeline_refuses_every_envpipe_setting(settings, virtual):
    with pytest.raises(EnvPipeConfigError) as info:
        EnvPipeConfig(**settings).validate_with_megatron_args(megatron(4, **virtual))
    text = str(info.value)
    flag = "--" + next(iter(virtual)).replace("_", "-")
    assert "no interleaved (virtual-pipeline) order" in text and "--envpipe-scheduling interleaved" in text and f"{flag} 2" in text
    assert all(f in text for f in _flags(settings)), text  # names what would have been ignored
    assert "--envpipe-type baseline --envpipe-scheduling 1f1b --envpipe-reconfig default" in text


@pytest.mark.parametrize("settings", NON_STOCK, ids=lambda s: "+".join(s.values()))
def test_no_pipeline_parallelism_refuses_every_envpipe_setting(settings):
    with pytest.raises(EnvPipeConfigError) as info:
        EnvPipeConfig(**settings).validate_with_megatron_args(megatron(1))
    text = str(info.value)
    assert text.startswith("EnvPipe needs pipeline parallelism: --pipeline-model-parallel-size is 1")
    assert "set --pipeline-model-parallel-size >= 2" in text
    assert all(f in text for f in _flags(settings)), text


@pytest.mark.parametrize("args", [megatron(1), *(megatron(4, **v) for v in VIRTUAL)],
                         ids=["pp1", *(next(iter(v)) for v in VIRTUAL)])
def test_megatrons_own_setting_is_accepted_everywhere(args):
    EnvPipeConfig().validate_with_megatron_args(args)


def test_pipelined_non_interleaved_envpipe_is_accepted():
    for settings in NON_STOCK:
        EnvPipeConfig(**settings).validate_with_megatron_args(megatron(4))


# -- install(): Megatron's other schedules run unchanged, logged once --------------------------

class Recorder:
    """Stands in for one of Megatron's schedules: records its calls, returns a marker."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return [f"{self.__name__} ran"]


@pytest.fixture
def stub_schedules(monkeypatch):
    """Megatron's interleaved and no-pipelining schedules replaced by recorders (restored after)."""
    pytest.importorskip("megatron.core", reason="needs torch and megatron-core: pip install -e '.[megatron]'")
    from megatron.core.pipeline_parallel import schedules

    import megatron_envpipe

    stubs = {name: Recorder(name) for name in ("forward_backward_pipelining_with_interleaving",
                                               "forward_backward_no_pipelining")}
    for name, stub in stubs.items():
        monkeypatch.setattr(schedules, name, stub)
    yield stubs
    megatron_envpipe.uninstall()


@pytest.mark.parametrize("pp,vp,name,needle", [
    (2, 2, "forward_backward_pipelining_with_interleaving", "virtual pipeline: Megatron's interleaved schedule runs"),
    (1, None, "forward_backward_no_pipelining", "no pipeline parallelism"),
], ids=["interleaved", "no-pipelining"])
def test_megatrons_other_schedules_run_unchanged_and_are_logged_once(stub_schedules, caplog, pp, vp, name, needle):
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    import megatron_envpipe

    stub = stub_schedules[name]
    megatron_envpipe.install(EnvPipeConfig(plan_type="envelope", scheduling="ours"))
    caplog.set_level(logging.INFO, logger="megatron_envpipe")
    for i in range(3):
        func = get_forward_backward_func(pp_size=pp, vp_size=vp)  # what megatron.training calls each iteration
        assert func is getattr(schedules, name) and func is not stub
        assert func(num_microbatches=i, forward_only=False) == [f"{name} ran"]
    assert stub.calls == [dict(num_microbatches=i, forward_only=False) for i in range(3)]  # Megatron's, unchanged
    logged = [r for r in caplog.records if needle in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert "without EnvPipe's order, clocks or energy reports" in logged[0].getMessage()

    megatron_envpipe.install(EnvPipeConfig())  # a new install() logs again, once
    get_forward_backward_func(pp_size=pp, vp_size=vp)(num_microbatches=1)
    get_forward_backward_func(pp_size=pp, vp_size=vp)(num_microbatches=1)
    assert len([r for r in caplog.records if needle in r.getMessage()]) == 2

    megatron_envpipe.uninstall()
    assert getattr(schedules, name) is stub  # restored


def test_pipelined_schedule_is_still_envpipes(stub_schedules):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import megatron_envpipe
    from megatron_envpipe.megatron.executor import envpipe_forward_backward

    megatron_envpipe.install(EnvPipeConfig())
    assert get_forward_backward_func(pp_size=2, vp_size=None) is envpipe_forward_backward
