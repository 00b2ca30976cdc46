"""What the executor tells the outside world while it runs a stage's program.

The executor calls :class:`ExecutionHooks` at every clock change and around
every unit, and hands over the iteration's measured unit timings at the end.
Implementations: :class:`ExecutionHooks` itself (does nothing),
:class:`RecordingHooks` (keeps every event, for tests and debugging), and the
GPU hooks of :mod:`megatron_envpipe.gpu` that lock SM clocks through NVML.
Pure Python: no torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_envpipe.core.length_costs import MicrobatchSize
from megatron_envpipe.core.measurement import IterationMeasurement
from megatron_envpipe.core.schedule import Unit


class ExecutionHooks:
    """No-op hooks; subclass and override what you need."""

    def iteration_begin(self, stage: int, iteration: int) -> None:
        """Before the stage's first instruction of an iteration."""

    def iteration_sizes(self, sizes: Sequence[MicrobatchSize] | None) -> None:
        """After ``iteration_begin``, before ``clock_plan``: this iteration's micro-batch sizes as the
        length model sees them, one per micro-batch (index = ``Unit.microbatch``); None: all
        micro-batches alike / unknown. The simulated GPU costs each unit at its size; the start-up
        profiler records each measured unit's size; real devices measure and need nothing."""

    def clock_plan(self, units: Sequence[Unit], freqs_mhz: Sequence[int],
                   times_s: Sequence[float] | None) -> None:
        """After ``iteration_begin``: the units this stage runs this iteration, in order, the SM
        clock each runs at, and each one's predicted time at that clock (simulated seconds of
        the profile the plan was made with; None: not known). Hooks that request a clock
        change ahead of a unit boundary need the next unit's clock while a unit runs."""

    def set_frequency(self, freq_mhz: int) -> None:
        """The program asks for this SM clock from the next unit on."""

    def instruction(self, instr: object) -> None:
        """Every instruction, right before it is dispatched (off by default: see ``wants_instructions``)."""

    wants_instructions = False

    def unit_begin(self, unit: Unit) -> None:
        """Right before a unit's compute (after its input arrived)."""

    def unit_end(self, unit: Unit) -> None:
        """Right after a unit's compute was issued."""

    def iteration_end(self, measurement: IterationMeasurement | None) -> None:
        """After the stage's last instruction; ``measurement`` when timing was on."""

    def close(self) -> None:
        """Release resources (e.g. reset GPU clocks)."""


@dataclass
class RecordingHooks(ExecutionHooks):
    """Records every event as a string, and every iteration's measurement."""

    events: list[str] = field(default_factory=list)
    measurements: list[IterationMeasurement] = field(default_factory=list)
    instructions: list[str] = field(default_factory=list)
    wants_instructions: bool = True
    # (units, clocks) of every clock_plan call; not an event, so event lists stay as they were
    clock_plans: list[tuple[tuple[str, ...], tuple[int, ...]]] = field(default_factory=list)
    # the sizes of every iteration_sizes call, in order; not an event either
    sizes: list[tuple[MicrobatchSize, ...] | None] = field(default_factory=list)

    def instruction(self, instr: object) -> None:
        self.instructions.append(str(instr))

    def iteration_begin(self, stage: int, iteration: int) -> None:
        self.events.append(f"begin S{stage} it{iteration}")

    def iteration_sizes(self, sizes: Sequence[MicrobatchSize] | None) -> None:
        self.sizes.append(None if sizes is None else tuple(sizes))

    def clock_plan(self, units: Sequence[Unit], freqs_mhz: Sequence[int],
                   times_s: Sequence[float] | None) -> None:
        self.clock_plans.append((tuple(str(u) for u in units), tuple(freqs_mhz)))

    def set_frequency(self, freq_mhz: int) -> None:
        self.events.append(f"freq {freq_mhz}")

    def unit_begin(self, unit: Unit) -> None:
        self.events.append(f"start {unit}")

    def unit_end(self, unit: Unit) -> None:
        self.events.append(f"end {unit}")

    def iteration_end(self, measurement: IterationMeasurement | None) -> None:
        self.events.append("end iteration")
        if measurement is not None:
            self.measurements.append(measurement)

    def units(self) -> list[str]:
        """The units in the order they ran, e.g. ``['F0', 'F1', 'B0', ...]``."""
        return [e.split()[1] for e in self.events if e.startswith("start ")]
