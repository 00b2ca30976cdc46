"""Everything about Megatron-core that depends on its version or on the device.

Megatron-core is imported lazily, inside the functions here, so that importing
``megatron_envpipe`` never pulls in torch or megatron. API differences between
releases are detected with ``inspect.signature`` rather than version numbers:
the releases we target (0.16.x on Python 3.11, 0.19.x) drift in small ways, and
feature checks keep working for releases in between.

The CPU shims let Megatron's own pipeline code (P2P, schedules, local attention,
RNG tracker) run on a CPU-only torch over gloo, for tests. They only redirect
CUDA device placement and CUDA synchronisation; they never touch arithmetic.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_envpipe.errors import EnvPipeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "MegatronUnavailableError",
    "ShimHandle",
    "call_backward_step",
    "call_forward_step",
    "check_megatron_installed",
    "cpu_shims",
    "model_parallel_manual_seed",
]

_INSTALL_HINT = (
    "megatron-core is required: `pip install megatron-core==0.16.1` (Python 3.11), or on "
    "Python 3.11 with 0.19.x: `pip install triton 'numpy<2.5' packaging && "
    "pip install --no-deps --ignore-requires-python megatron-core==0.19.2`"
)


class MegatronUnavailableError(EnvPipeError, ImportError):
    """megatron-core (or a module it needs at import time) is not installed."""


def check_megatron_installed() -> None:
    """Fail fast, without importing megatron, when megatron-core is absent."""
    if importlib.util.find_spec("megatron") is None or (
        importlib.util.find_spec("megatron.core") is None
    ):
        raise MegatronUnavailableError(_INSTALL_HINT)


def _require_megatron() -> types.ModuleType:
    """Import ``megatron.core``, turning a missing dependency into a clear error."""
    try:
        return importlib.import_module("megatron.core")
    except ModuleNotFoundError as exc:
        # 0.19.x imports triton unconditionally (schedules -> moe paged_stash);
        # CPU builds of torch do not depend on it, so name it explicitly.
        missing = exc.name or ""
        if missing.split(".")[0] in ("megatron", "triton"):
            raise MegatronUnavailableError(f"{_INSTALL_HINT} (missing module: {missing})") from exc
        raise


# --------------------------------------------------------------------------- features


@dataclass(frozen=True)
class _MegatronFeatures:
    """API facts about the installed megatron-core, found by introspection."""

    version: str
    forward_step_params: frozenset[str]
    backward_step_params: frozenset[str]
    get_forward_backward_func_params: frozenset[str]
    has_p2p_communicator: bool
    # 0.19 adds is_pp_first_stage / is_pp_last_stage / total_stages / current_stage.
    p2p_has_stage_properties: bool

    @property
    def backward_step_takes_model_type(self) -> bool:
        return "model_type" in self.backward_step_params


def _param_names(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


@functools.cache
def _features() -> _MegatronFeatures:
    """Introspect the installed megatron-core once per process."""
    core = _require_megatron()
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication")
    communicator = getattr(p2p, "P2PCommunicator", None)
    return _MegatronFeatures(
        version=str(getattr(core, "__version__", "unknown")),
        forward_step_params=_param_names(schedules.forward_step),
        backward_step_params=_param_names(schedules.backward_step),
        get_forward_backward_func_params=_param_names(schedules.get_forward_backward_func),
        has_p2p_communicator=communicator is not None,
        p2p_has_stage_properties=communicator is not None
        and all(
            hasattr(communicator, name)
            for name in ("is_pp_first_stage", "is_pp_last_stage", "total_stages", "current_stage")
        ),
    )


# --------------------------------------------------------------------------- per-unit calls

# Optional forward_step keywords and the value meaning "not used". An installed
# version that lacks one of them may only be called with that value, so no
# caller intent is ever dropped silently.
_FORWARD_STEP_OPTIONAL: dict[str, Any] = {
    "collect_non_loss_data": False,
    "checkpoint_activations_microbatch": None,
    "is_first_microbatch": False,
    "current_microbatch": None,
    "vp_stage": None,
}


def call_forward_step(
    forward_step_func: Callable[..., Any],
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    input_tensor: Any,
    forward_data_store: list[Any],
    config: Any,
    *,
    cp_group_size: int,
    is_last_stage: bool,
    collect_non_loss_data: bool = False,
    checkpoint_activations_microbatch: bool | None = None,
    is_first_microbatch: bool = False,
    current_microbatch: int | None = None,
    vp_stage: int | None = None,
) -> tuple[Any, torch.Tensor]:
    """Megatron's ``schedules.forward_step`` with only the keywords it accepts.

    ``cp_group_size`` and ``is_last_stage`` must always be given: 0.16-0.19 have no
    usable default (``is_last_stage=True`` would run the loss on every stage).
    Releases without them derive both from ``parallel_state``, so they are dropped
    there. Returns ``(output_tensor, num_tokens)``.
    """
    from megatron.core.pipeline_parallel import schedules

    accepted = _features().forward_step_params
    required: dict[str, Any] = {"cp_group_size": cp_group_size, "is_last_stage": is_last_stage}
    kwargs = {name: value for name, value in required.items() if name in accepted}
    optional: dict[str, Any] = {
        "collect_non_loss_data": collect_non_loss_data,
        "checkpoint_activations_microbatch": checkpoint_activations_microbatch,
        "is_first_microbatch": is_first_microbatch,
        "current_microbatch": current_microbatch,
        "vp_stage": vp_stage,
    }
    for name, value in optional.items():
        if name in accepted:
            kwargs[name] = value
        elif value != _FORWARD_STEP_OPTIONAL[name]:
            raise TypeError(
                f"megatron-core {_features().version} forward_step does not accept {name}={value!r}"
            )
    return schedules.forward_step(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        input_tensor,
        forward_data_store,
        config,
        **kwargs,
    )


def call_backward_step(
    input_tensor: Any,
    output_tensor: Any,
    output_tensor_grad: Any,
    config: Any,
    model_type: Any = None,
) -> Any:
    """Megatron's ``schedules.backward_step`` across the ``model_type`` removal.

    0.16 requires ``model_type`` (``None`` here means ``ModelType.encoder_or_decoder``);
    0.19 dropped the parameter. Since 0.16 that enum has no other member, so
    leaving it out loses nothing. Returns the gradient(s) w.r.t. ``input_tensor``.
    """
    from megatron.core.pipeline_parallel import schedules

    kwargs: dict[str, Any] = {
        "input_tensor": input_tensor,
        "output_tensor": output_tensor,
        "output_tensor_grad": output_tensor_grad,
        "config": config,
    }
    if _features().backward_step_takes_model_type:
        if model_type is None:
            from megatron.core.enums import ModelType

            model_type = ModelType.encoder_or_decoder
        kwargs["model_type"] = model_type
    return schedules.backward_step(**kwargs)


# --------------------------------------------------------------------------- seeding


def model_parallel_manual_seed(seed: int) -> None:
    """Seed torch and Megatron's model-parallel RNG tracker, on CPU or CUDA.

    Call after ``initialize_model_parallel``. On a CPU run, call it inside
    ``cpu_shims()``: Megatron's ``model_parallel_cuda_manual_seed`` then registers
    its named states (same names, same derived seeds) in the CPU tracker the
    shims install instead of failing on ``torch.cuda.get_rng_state``.
    """
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


@functools.cache
def _cpu_rng_tracker_class() -> type:
    """A subclass of Megatron's tracker whose named states are CPU generator states.

    Megatron forks its device RNG stream around dropout in tensor-parallel regions
    (local attention forks on every forward). Subclassing keeps Megatron's own
    bookkeeping (names, seed uniqueness, get/set_states, isinstance checks); only
    the generator that is swapped in and out becomes the CPU default generator.
    """
    import torch
    from megatron.core.tensor_parallel import random as mp_random

    base = mp_random.CudaRNGStatesTracker
    default_fork_name = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME
    idle_name = "default-rng"  # base class's name for "no named state active"

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        # Set by the base class's reset(); declared for type checkers.
        _current_state_name: str

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = default_fork_name) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer = self._current_state_name
            entry_state = torch.get_rng_state()
            if outer != idle_name:
                self.states_[outer] = entry_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(entry_state if outer == idle_name else self.states_[outer])
                self._current_state_name = outer

    return CpuRNGStatesTracker


# --------------------------------------------------------------------------- CPU shims

# Tensor factories whose device="cuda" argument the CPU view of torch rewrites.
_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "arange"})


class _CpuPlacedTorch(types.ModuleType):
    """``torch`` as seen by one Megatron module on a CPU run.

    Identical to torch except that the tensor factories above place a
    ``device="cuda"`` request on the CPU. Megatron's schedules allocate their
    ``total_num_tokens`` counter with a hard-coded ``device="cuda"``.
    """

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real_torch = real

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real_torch, name)
        if name not in _FACTORIES:
            return attr
        device_type = self._real_torch.device

        @functools.wraps(attr)
        def factory(*args: Any, **kwargs: Any) -> Any:
            device = kwargs.get("device")
            if device is not None and device_type(device).type == "cuda":
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


def _cpu_device() -> torch.device:
    import torch

    return torch.device("cpu")


def _no_synchronize(device: Any = None) -> None:
    """CPU kernels are synchronous and gloo's ``wait()`` completes transfers."""


class ShimHandle:
    """The patches one ``_install_cpu_shims()`` applied, with the values they replaced."""

    def __init__(self) -> None:
        # (object, attribute, existed before, original value), in application order.
        self._applied: list[tuple[object, str, bool, Any]] = []

    @property
    def active(self) -> bool:
        return bool(self._applied)

    def record(self, target: object, attr: str) -> None:
        self._applied.append((target, attr, hasattr(target, attr), getattr(target, attr, None)))

    def uninstall(self) -> None:
        """Restore every patched attribute, last first, so nested installs unwind."""
        while self._applied:
            target, attr, existed, original = self._applied.pop()
            if existed:
                setattr(target, attr, original)
            else:
                delattr(target, attr)


def _cpu_patches() -> list[tuple[object, str, Any]]:
    import torch
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random

    return [
        # P2PCommunicator allocates receive and shape buffers, and local attention's
        # GlobalMemoryBuffer its scratch tensor, on torch.cuda.current_device().
        (torch.cuda, "current_device", _cpu_device),
        # P2P calls torch.cuda.synchronize() after batched send/recv (batch_p2p_sync)
        # and after the variable-shape handshake.
        (torch.cuda, "synchronize", _no_synchronize),
        # forward_backward_* allocate total_num_tokens with device="cuda".
        (schedules, "torch", _CpuPlacedTorch(torch)),
        # model_parallel_cuda_manual_seed and attention's rng fork read/write CUDA
        # generator state; a ready CPU tracker makes initialize_rng_tracker keep it.
        (mp_random, "_CUDA_RNG_STATE_TRACKER", _cpu_rng_tracker_class()()),
        (mp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True),
    ]


def _install_cpu_shims() -> ShimHandle:
    """Patch Megatron/torch so Megatron's pipeline code runs on CPU; see ``cpu_shims``."""
    handle = ShimHandle()
    for target, attr, value in _cpu_patches():
        handle.record(target, attr)
        setattr(target, attr, value)
    return handle


@contextlib.contextmanager
def cpu_shims(device: torch.device | str = "cpu") -> Iterator[ShimHandle | None]:
    """Apply the CPU shims for the duration of the block when ``device`` is a CPU.

    On any other device this is a no-op and yields ``None``: real CUDA runs must
    see Megatron unmodified. Everything patched is restored on exit, also on error.
    Process-wide state, like the RNG tracker, is restored too, so seed inside the
    block and build models inside it.
    """
    import torch

    if torch.device(device).type != "cpu":
        yield None
        return
    handle = _install_cpu_shims()
    try:
        yield handle
    finally:
        handle.uninstall()
