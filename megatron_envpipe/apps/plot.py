"""Gantt charts of simulated iterations (stages x time, units coloured by clock).

Needs matplotlib (``pip install 'megatron-envpipe[plot]'``); imported only
when a picture is asked for. ``*_image`` render to bytes in memory, so a
command can write its picture together with its other outputs, all or none
(:func:`~megatron_envpipe.core.atomic.write_all_atomic`); ``draw_*`` write a
file atomically.
"""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Sequence
from pathlib import Path

from megatron_envpipe.core.atomic import write_atomic
from megatron_envpipe.core.plan import FrequencyPlan
from megatron_envpipe.core.timeline import Timeline
from megatron_envpipe.errors import UsageError
from megatron_envpipe.planning.frontier import Frontier
from megatron_envpipe.planning.optimal import InfeasibleDeadline


class PlotUnavailableError(UsageError):
    """A picture was asked for but matplotlib is not installed."""


class ImageFormatError(UsageError, ValueError):
    """A picture's file name does not end in an image format we can write."""


# What matplotlib's Agg backend writes by itself, by file suffix (fixed here so a bad name is
# caught before matplotlib is imported); pgf needs LaTeX, gif/avif need optional Pillow codecs.
_IMAGE_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def image_format(path: str | Path) -> str:
    """The format of a picture named ``path``, from its suffix; ImageFormatError for none or an unknown one."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in _IMAGE_FORMATS:
        got = f"unknown image format '.{suffix}'" if suffix else "no image format suffix"
        raise ImageFormatError(f"{path}: {got}: end the name with one of .{', .'.join(_IMAGE_FORMATS)}")
    return suffix


def check_plot_path(path: str | Path) -> str:
    """Before any work: the format of ``path``, and matplotlib is there to draw it (without importing it)."""
    fmt = image_format(path)
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailableError(
            "drawing needs matplotlib: pip install 'megatron-envpipe[plot]' (or pip install matplotlib)"
        )
    return fmt


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(
            "drawing needs matplotlib: pip install 'megatron-envpipe[plot]' (or pip install matplotlib)"
        ) from None
    return matplotlib, plt


def draw_timelines(
    panels: Sequence[tuple[str, FrequencyPlan, Timeline]],
    path: str | Path,
    f_min_mhz: int | None = None,
    f_max_mhz: int | None = None,
) -> Path:
    """:func:`timelines_image` written to ``path`` (atomically; the format from its suffix)."""
    return write_atomic(path, timelines_image(panels, image_format(path), f_min_mhz, f_max_mhz))


def timelines_image(
    panels: Sequence[tuple[str, FrequencyPlan, Timeline]],
    fmt: str = "png",
    f_min_mhz: int | None = None,
    f_max_mhz: int | None = None,
) -> bytes:
    """One Gantt panel per (title, plan, timeline), sharing the time axis and colour scale, as a ``fmt`` image.

    Forwards are drawn lighter than backwards' hatch-free bars; critical-path
    units get a black outline, so the envelope is visible at a glance.
    """
    matplotlib, plt = _matplotlib()
    all_freqs = [f for _, plan, _ in panels for f in plan.flat()]
    lo = f_min_mhz if f_min_mhz is not None else min(all_freqs)
    hi = f_max_mhz if f_max_mhz is not None else max(all_freqs)
    if lo == hi:
        lo -= 1
    norm = matplotlib.colors.Normalize(vmin=lo, vmax=hi)
    cmap = matplotlib.colormaps["viridis"]
    t_max = max(tl.iteration_time_s for _, _, tl in panels)
    num_stages = max(plan.schedule.num_stages for _, plan, _ in panels)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(12, 1.0 + 0.42 * num_stages * len(panels)), sharex=True, squeeze=False
    )
    for ax, (title, plan, tl) in zip(axes[:, 0], panels):
        critical = set(tl.critical_path())
        freqs = plan.flat()
        for v, (s, unit) in enumerate(tl.graph.nodes):
            start, dur = tl.start_s[v], tl.duration_s[v]
            ax.barh(
                s,
                dur,
                left=start,
                height=0.8,
                color=cmap(norm(freqs[v])),
                alpha=0.75 if unit.is_forward else 1.0,
                edgecolor="black" if v in critical else "white",
                linewidth=1.2 if v in critical else 0.3,
            )
            if dur > t_max / 80:
                ax.text(start + dur / 2, s, str(unit), ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(plan.schedule.num_stages))
        ax.set_yticklabels([f"stage {s}" for s in range(plan.schedule.num_stages)], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, t_max * 1.01)
        ax.set_title(f"{title} — iteration {tl.iteration_time_s:.3f} s", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time (s)")
    fig.colorbar(
        matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes[:, 0].tolist(), label="SM clock (MHz)", pad=0.01
    )
    return _image_bytes(plt, fig, fmt, dpi=130, bbox_inches="tight")


def frontier_image(
    frontier: Frontier,
    fmt: str = "png",
    target_time_s: float | None = None,
    others: Sequence[tuple[str, float, float]] = (),
) -> bytes:
    """Energy vs iteration time: the frontier, the baseline, ``others`` (label, time, energy), the target."""
    _, plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    xs = [pt.time_s for pt in frontier.points]
    ys = [pt.energy_j for pt in frontier.points]
    ax.plot(xs, ys, "o-", color="tab:blue", ms=3.5, lw=1.5,
            label=f"optimal plans ({frontier.schedule.name}, {len(xs)} points)")
    b = frontier.baseline
    ax.plot([b.iteration_time_s], [b.energy_j], "s", color="black", ms=7, label="1F1B at f_max (baseline)")
    styles = iter([("^", "tab:orange"), ("D", "tab:green"), ("v", "tab:purple"), ("P", "tab:brown")])
    for label, t, e in others:
        marker, color = next(styles, ("*", "tab:gray"))
        ax.plot([t], [e], marker, color=color, ms=7, label=label)
    if target_time_s is not None:
        try:
            pt, e_at, base_at = frontier.pick(target_time_s)
        except InfeasibleDeadline:
            pt = None
        ax.axvline(target_time_s, color="tab:red", ls="--", lw=1, label=f"target {target_time_s:.4g} s")
        if pt is not None:
            ax.plot([pt.time_s], [pt.energy_j], "o", mfc="none", mec="tab:red", ms=11, mew=2,
                    label=f"picked: {100 * (1 - e_at / base_at):.1f} % less energy at the target")
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("iteration energy (J)")
    ax.set_title(f"time-energy frontier: {frontier.num_stages} stages x {frontier.schedule.num_microbatches} "
                 f"micro-batches, P2P {frontier.p2p_power_w:g} W")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _image_bytes(plt, fig, fmt, dpi=110)


def _image_bytes(plt, fig, fmt: str, **savefig) -> bytes:
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format=fmt, **savefig)
    finally:
        plt.close(fig)
    return buf.getvalue()
