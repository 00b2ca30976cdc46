"""Energy of labelled windows from an :class:`~megatron_envpipe.gpu.energy.monitor.EnergyMonitor` trace,
and the per-unit samples the start-up profiler (:mod:`megatron_envpipe.gpu.profiler.sweep`) is fed.

:func:`_attribute_windows` interpolates the trace at each window's edges;
:func:`_fit_window_powers` fits one power per label to every counter increment,
which stays exact for windows shorter than the counter's update period. Both
raise the monitor's :class:`~megatron_envpipe.gpu.energy.monitor.EnergyMonitorError`
when the trace cannot answer (a gap, a stalled or failing counter).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from megatron_envpipe.core.length_costs import MicrobatchSize
from megatron_envpipe.errors import EnvPipeError, InvalidValueError
from megatron_envpipe.gpu.energy.monitor import EnergyMonitor

__all__ = [
    "ATTRIBUTION_METHODS", "BlockingSample", "KindPowers", "PowerFit", "StageSamples",
    "UnitSample", "UnitWindow", "attribute_blocking", "attribute_units", "stage_samples",
]


class _InseparablePowersError(EnvPipeError, ValueError):
    """The counter samples cannot tell the labels' powers apart (too few samples)."""


def _attribute_windows(
    monitor: EnergyMonitor, windows: Sequence[tuple[float, float]], wait_timeout_s: float = 1.0
) -> list[float]:
    """Energy (J) of each ``(t0, t1)`` window; waits until the trace covers the last one."""
    if not windows:
        return []
    monitor.wait_covered(max(t1 for _, t1 in windows), timeout_s=wait_timeout_s)
    return [monitor.energy_j(t0, t1) for t0, t1 in windows]


def _fit_window_powers(
    monitor: EnergyMonitor,
    windows: Sequence[tuple[str, float, float]],
    other_label: str = "other",
    wait_timeout_s: float = 1.0,
) -> dict[str, float]:
    """Power of each label (:func:`_fit_window_powers_se` without the standard errors)."""
    return {lbl: p for lbl, (p, _) in _fit_window_powers_se(monitor, windows, other_label, wait_timeout_s).items()}


def _fit_window_powers_se(
    monitor: EnergyMonitor,
    windows: Sequence[tuple[str, float, float]],
    other_label: str = "other",
    wait_timeout_s: float = 1.0,
) -> dict[str, tuple[float, float]]:
    """Power of each label of ``(label, t0, t1)`` windows, by least squares on the counter.

    Interpolation blends a window's power with its neighbours' wherever the
    samples around its edges straddle a power jump. If instead each label has
    one constant power (all forwards of an iteration at one clock), every
    counter increment ``E_i - E_(i-1)`` is ``sum_label P_label * overlap_label(i)``,
    a small linear system that is exact even for windows shorter than the
    counter period. Time not in any window is ``other_label``. Windows must not
    overlap (ValueError). Returns ``label -> (power, standard error)`` in joules
    per second of the monitor's clock; the standard error comes from the
    residuals of the increments (power that is not constant per label, counter
    updates stamped off their tick, the counter's 1 mJ step) and is 0 without
    spare increments. Raises :class:`_InseparablePowersError` if the labels
    cannot be told apart.
    """
    fit = _fit_window_powers_cov(monitor, windows, other_label, wait_timeout_s)
    return {lbl: (p, math.sqrt(max(fit.covariance[(lbl, lbl)], 0.0))) for lbl, p in fit.powers.items()}


@dataclass(frozen=True)
class PowerFit:
    """Fitted power per label (W) and the fit's covariance of every pair of labels (W^2)."""

    powers: dict[str, float]
    covariance: dict[tuple[str, str], float]
    increments: int = 0  # counter increments the fit saw


def _fit_window_powers_cov(
    monitor: EnergyMonitor,
    windows: Sequence[tuple[str, float, float]],
    other_label: str = "other",
    wait_timeout_s: float = 1.0,
) -> PowerFit:
    """:func:`_fit_window_powers_se` with the whole covariance: short forwards and backwards that
    alternate faster than the counter updates are told apart only along one direction (their sum
    is sharp, their difference is not), which the standard errors alone do not say."""
    if not windows:
        return PowerFit({}, {})
    ws = sorted((float(a), float(b), str(lbl)) for lbl, a, b in windows)
    for (a0, b0, l0), (a1, _, l1) in zip(ws, ws[1:]):
        if a1 < b0:
            raise ValueError(f"windows overlap: {l0} [{a0}, {b0}] and {l1} starting at {a1}")
    span0, span1 = ws[0][0], max(b for _, b, _ in ws)
    monitor.wait_covered(span1, timeout_s=wait_timeout_s)
    monitor.energy_j(span0, span1)  # raises, naming why, if the trace does not cover the span
    samples = monitor.samples_between(span0, span1)
    # Segments tiling the time line: windows, and other_label in between and outside.
    segments: list[tuple[float, float, str]] = []
    t = -math.inf
    for a, b, lbl in ws:
        if a > t:
            segments.append((t, a, other_label))
        segments.append((a, b, lbl))
        t = b
    segments.append((t, math.inf, other_label))
    labels = sorted({lbl for _, _, lbl in segments})
    index = {lbl: i for i, lbl in enumerate(labels)}
    k = len(labels)
    normal = [[0.0] * k for _ in range(k)]
    rhs = [0.0] * k
    seg = 0
    increments: list[tuple[list[float], float]] = []
    for prev, cur in zip(samples, samples[1:]):
        t_a, t_b = prev.time_s, cur.time_s
        row = [0.0] * k
        while segments[seg][1] <= t_a:
            seg += 1
        j = seg
        while j < len(segments) and segments[j][0] < t_b:
            a, b, lbl = segments[j]
            row[index[lbl]] += min(b, t_b) - max(a, t_a)
            j += 1
        d_j = (cur.energy_mj - prev.energy_mj) / 1000.0
        increments.append((row, d_j))
        for r in range(k):
            if row[r]:
                rhs[r] += row[r] * d_j
                for c in range(k):
                    normal[r][c] += row[r] * row[c]
    present = [i for i in range(k) if normal[i][i] > 0]
    solution = _solve([[normal[r][c] for c in present] for r in present], [rhs[r] for r in present])
    if solution is None:
        raise _InseparablePowersError(
            f"cannot separate the powers of {[labels[i] for i in present]}: too few counter samples"
        )
    # A stepped counter's increments have edges (its updates) stamped to within a poll: at the power
    # drawn, an error no residual shows where many increments repeat one mix of labels.
    span_s = samples[-1].time_s - samples[0].time_s
    mean_power_w = (samples[-1].energy_mj - samples[0].energy_mj) / 1000.0 / span_s if span_s > 0 else 0.0
    stepped = monitor.counter_period_s != 0  # an exact counter's reads are stamped exactly (None: not yet known)
    stamp_j = abs(mean_power_w) * monitor.poll_interval_s if stepped else 0.0
    names = [labels[i] for i in present]
    cov = _covariance(normal, present, solution, increments, stamp_j)
    return PowerFit(dict(zip(names, solution)),
                    {(a, b): cov[i][j] for i, a in enumerate(names) for j, b in enumerate(names)}, len(increments))


def _covariance(normal: list[list[float]], present: list[int], solution: list[float],
                increments: list[tuple[list[float], float]], stamp_j: float = 0.0) -> list[list[float]]:
    """Least-squares covariance sigma^2 (A^T A)^-1, sigma^2 from the residuals, at least the counter's
    1 mJ step (uniform: (1e-3 J)^2 / 12 per increment) and the stamps' error (``stamp_j``: the energy
    of one poll interval; two edges, each uniform over it: stamp_j^2 / 6); without spare increments
    those floors alone. Infinite on the diagonal where a label cannot be solved for."""
    k = len(present)
    dof = len(increments) - k
    rss = math.fsum((d - math.fsum(row[i] * p for i, p in zip(present, solution))) ** 2 for row, d in increments)
    sigma2 = max(rss / dof if dof > 0 else 0.0, 1e-6 / 12, stamp_j ** 2 / 6)
    reduced = [[normal[r][c] for c in present] for r in present]
    out = [[0.0] * k for _ in range(k)]
    for j in range(k):
        col = _solve(reduced, [1.0 if i == j else 0.0 for i in range(k)])
        for i in range(k):
            out[i][j] = sigma2 * col[i] if col is not None else (math.inf if i == j else 0.0)
    return out


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if (nearly) singular."""
    n = len(b)
    scale = max((abs(a[i][i]) for i in range(n)), default=0.0)
    if scale == 0.0:
        return None
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


# -- samples -----------------------------------------------------------------------------
@dataclass(frozen=True)
class UnitSample:
    """One forward (``F``) or backward (``B``) unit: device seconds and joules."""

    kind: str
    time_s: float
    energy_j: float
    chunk: int = 0  # the unit's model chunk (Megatron's interleaved pipeline)
    energy_se_j: float = 0.0  # standard error of energy_j from the attribution (0: not known)
    size: MicrobatchSize | None = None  # its micro-batch's size (variable lengths); None: not given


@dataclass(frozen=True)
class BlockingSample:
    """A window in which the GPU waited for a P2P transfer (no compute)."""

    time_s: float
    energy_j: float


@dataclass(frozen=True)
class KindPowers:
    """One iteration's fitted forward and backward power (W) with their covariance (W^2): the start-up
    profiler's prior on their ratio (:mod:`megatron_envpipe.gpu.profiler.power_ratio`) needs the whole of it."""

    forward_w: float
    backward_w: float
    var_forward: float
    var_backward: float
    cov: float

    @classmethod
    def of(cls, fit: PowerFit) -> "KindPowers | None":
        """From a fit with both kinds (None without them, or with a covariance that is not finite)."""
        f, b = "F", "B"
        if f not in fit.powers or b not in fit.powers:
            return None
        out = cls(fit.powers[f], fit.powers[b], fit.covariance[(f, f)], fit.covariance[(b, b)],
                  fit.covariance[(f, b)])
        values = (out.forward_w, out.backward_w, out.var_forward, out.var_backward, out.cov)
        return out if all(math.isfinite(v) for v in values) and out.forward_w > 0 and out.backward_w > 0 else None


@dataclass(frozen=True)
class StageSamples:
    """One stage's samples of one iteration."""

    units: tuple[UnitSample, ...]
    blocking: tuple[BlockingSample, ...] = ()
    at_s: float | None = None  # the iteration's middle, device seconds on the monitor's clock (heat drift)
    kind_powers: KindPowers | None = None  # the power fit's (regression attribution only)
    counter_updates: int | None = None  # counter increments the iteration's fit saw (None: not fitted)

    @classmethod
    def of(
        cls,
        units: Iterable[UnitSample | tuple[str, float, float]],
        blocking: Iterable[BlockingSample | tuple[float, float]] = (),
    ) -> "StageSamples":
        """From dataclasses or plain ``(kind, time_s, energy_j)`` / ``(time_s, energy_j)`` tuples."""
        return cls(
            tuple(u if isinstance(u, UnitSample) else UnitSample(*u) for u in units),
            tuple(b if isinstance(b, BlockingSample) else BlockingSample(*b) for b in blocking),
        )


@dataclass(frozen=True)
class UnitWindow:
    """A unit's compute window on the monitor's clock (after CUDA synchronisation)."""

    kind: str
    start_s: float
    end_s: float


# -- attribution -------------------------------------------------------------------------
def attribute_units(
    monitor: EnergyMonitor,
    windows: Sequence[UnitWindow | tuple[str, float, float]],
    time_scale: float = 1.0,
    wait_timeout_s: float = 1.0,
) -> list[UnitSample]:
    """Time and energy of each unit window from the monitor's interpolated trace.

    ``time_scale`` converts wall to device seconds (a :class:`SimulatedGpu`'s
    ``time_scale``; 1 on real GPUs). Energy needs no scaling.
    """
    ws = [w if isinstance(w, UnitWindow) else UnitWindow(*w) for w in windows]
    energies = _attribute_windows(monitor, [(w.start_s, w.end_s) for w in ws], wait_timeout_s)
    return [UnitSample(w.kind, (w.end_s - w.start_s) / time_scale, e) for w, e in zip(ws, energies)]


def attribute_blocking(
    monitor: EnergyMonitor,
    windows: Sequence[tuple[float, float]],
    time_scale: float = 1.0,
    min_time_s: float = 0.0,
    wait_timeout_s: float = 1.0,
) -> list[BlockingSample]:
    """Blocking windows at least ``min_time_s`` wall seconds long.

    Short windows are dominated by interpolation error at their edges (compute
    power on both sides), so keep ones several counter periods long (NVML: ~100 ms on A100).
    """
    kept = [(t0, t1) for t0, t1 in windows if t1 - t0 >= min_time_s and t1 > t0]
    energies = _attribute_windows(monitor, kept, wait_timeout_s)
    return [BlockingSample((t1 - t0) / time_scale, e) for (t0, t1), e in zip(kept, energies)]


ATTRIBUTION_METHODS = ("regress", "interpolate")
_BLOCKING = "blocking"  # label of P2P blocking windows in the power fit


def stage_samples(
    monitor: EnergyMonitor,
    units: Sequence[UnitWindow | tuple[str, float, float]],
    blocking: Sequence[tuple[float, float]] = (),
    time_scale: float = 1.0,
    min_blocking_s: float = 0.0,
    wait_timeout_s: float = 1.0,
    method: str = "regress",
    span: tuple[float, float] | None = None,
) -> StageSamples:
    """One stage's :class:`StageSamples` of one iteration, from its windows.

    ``span``: when the stage's iteration began and ended (its first unit waited for its input before,
    its last one for the pipeline after): those waits are P2P waits too, and counting them as such
    leaves fewer unknowns to the power fit (short iterations on a fast GPU give it few increments).

    ``method="interpolate"``: each window's energy from the interpolated trace
    (Perseus/Merak; biased towards the neighbours' power where a window's edges
    fall between counter samples). ``"regress"`` (default): one power per kind
    (F, B, blocking, the rest) fitted to all counter increments of the
    iteration (:func:`~megatron_envpipe.gpu.profiler.attribution._fit_window_powers`), exact for a
    constant power per kind, which holds within a profiling iteration (one
    clock); falls back to interpolation if the kinds cannot be separated.
    """
    if method not in ATTRIBUTION_METHODS:
        raise InvalidValueError(f"method {method!r}: choose one of {', '.join(ATTRIBUTION_METHODS)}")
    ws = [w if isinstance(w, UnitWindow) else UnitWindow(*w) for w in units]
    if span is not None and ws:
        first, last = min(w.start_s for w in ws), max(w.end_s for w in ws)
        begin_s, end_s = span
        if math.isfinite(begin_s) and math.isfinite(end_s) and begin_s <= first and last <= end_s:
            blocking = [(begin_s, first), *blocking, (last, end_s)]
    kept = [(t0, t1) for t0, t1 in blocking if t1 > t0 and t1 - t0 >= min_blocking_s]
    at_s = 0.5 * (min(w.start_s for w in ws) + max(w.end_s for w in ws)) / time_scale if ws else None
    if method == "regress":
        labelled = [(w.kind, w.start_s, w.end_s) for w in ws]
        # All blocking windows (not only the long ones) get their own label, so
        # their power does not leak into "the rest".
        labelled += [(_BLOCKING, t0, t1) for t0, t1 in blocking if t1 > t0]
        try:
            fit = _fit_window_powers_cov(monitor, labelled, wait_timeout_s=wait_timeout_s)
        except _InseparablePowersError:
            fit = PowerFit({}, {})
        powers = fit.powers
        stepped = monitor.counter_period_s != 0  # as the fit left it (None: the period is still being measured)
        fitted = {k: (p, math.sqrt(max(fit.covariance[(k, k)], 0.0))) for k, p in powers.items()}
        needed = {w.kind for w in ws} | ({_BLOCKING} if kept else set())
        # A label the fit could not see, or a negative/absurd power (noise on a label
        # with little time), falls back to interpolation for this iteration.
        if all(math.isfinite(powers.get(k, math.nan)) and powers[k] >= 0 for k in needed):
            return StageSamples(
                tuple(
                    UnitSample(w.kind, (w.end_s - w.start_s) / time_scale, powers[w.kind] * (w.end_s - w.start_s),
                               energy_se_j=fitted[w.kind][1] * (w.end_s - w.start_s))
                    for w in ws
                ),
                tuple(BlockingSample((t1 - t0) / time_scale, powers[_BLOCKING] * (t1 - t0)) for t0, t1 in kept),
                at_s=at_s,
                # An exact counter resolves every kind exactly: no prior on their ratio is needed there.
                kind_powers=KindPowers.of(fit) if stepped else None,
                counter_updates=fit.increments if stepped else None,
            )
    return StageSamples(
        tuple(replace(u, energy_se_j=_edge_error_j(monitor, w.start_s, w.end_s))
              for u, w in zip(attribute_units(monitor, ws, time_scale, wait_timeout_s), ws)),
        tuple(attribute_blocking(monitor, kept, time_scale, 0.0, wait_timeout_s)),
        at_s=at_s,
    )


def _edge_error_j(monitor: EnergyMonitor, t0: float, t1: float) -> float:
    """Interpolation's error bound on ``[t0, t1]``: at each edge, the power around it (the larger of
    the two sample intervals' average powers) x the spacing of the samples around it / 4."""
    total = 0.0
    for t in (t0, t1):
        around = monitor.samples_between(t, t)
        if len(around) >= 2:
            spans = [(b.time_s - a.time_s, (b.energy_mj - a.energy_mj) / 1000.0) for a, b in zip(around, around[1:])]
            spacing = max(dt for dt, _ in spans)
            power = max((de / dt for dt, de in spans if dt > 0), default=0.0)
            total += power * spacing / 4
    return total
