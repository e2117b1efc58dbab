"""report.png: loss curve, step time, a goodput timeline with one bar per attempt, and each
attempt's time to its first step split by phase (scripts.report.phases).

Uses matplotlib's object API with the Agg canvas (no pyplot, no display, no global state).
"""

from __future__ import annotations

import io

from scripts.report.goodput import BADPUT_LABELS, Timeline
from scripts.report.phases import PHASE_LABELS, PHASES

COLOURS: dict[str, str] = {
    "productive": "#2e9d4a",
    "startup": "#7f7f7f",
    "compile": "#9467bd",
    "restore": "#1f77b4",
    "checkpoint": "#ff7f0e",
    "lost": "#d62728",
    "idle": "#e0e0e0",
    "repair": "#c49c94",
    "other": "#bcbd22",
}
LABELS: dict[str, str] = {"productive": "productive steps", **BADPUT_LABELS}
PHASE_COLOURS: dict[str, str] = {
    "boot": "#8c564b", "environment": "#e377c2", "imports": "#7f7f7f", "distributed": "#17becf",
    "restore": "#1f77b4", "compile": "#9467bd", "first_step": "#2e9d4a", "other": "#bcbd22",
}


def render_png(timeline: Timeline, title: str) -> bytes:
    """The four-panel figure as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    attempts = timeline.attempts
    rows_height = max(1.5, 0.45 * len(attempts) + 1)
    fig = Figure(figsize=(10, 9.5 + rows_height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, time_ax, bar_ax, phase_ax = fig.subplots(
        4, 1, height_ratios=(3, 2, rows_height, rows_height))
    fig.suptitle(title)
    colours = [f"C{k % 10}" for k in range(len(attempts))]

    for attempt, colour in zip(attempts, colours, strict=True):
        runs = [s for s in timeline.steps if s.attempt == attempt.index]
        with_loss = [s for s in runs if s.loss is not None]
        label = f"attempt {attempt.index}"
        if with_loss:
            loss_ax.plot([s.step for s in with_loss], [s.loss for s in with_loss], color=colour,
                         label=label, linewidth=1.2)
        if runs:
            time_ax.plot([s.step for s in runs], [1e3 * s.step_time_s for s in runs], ".",
                         color=colour, markersize=3, label=label)
        if attempt.restored_step:
            for ax in (loss_ax, time_ax):
                ax.axvline(attempt.restored_step, color=colour, linestyle=":", linewidth=1)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("loss (dotted: the step a restart resumed from)", fontsize=10)
    time_ax.set_ylabel("step time (ms)")
    time_ax.set_xlabel("global step")
    if any(s.step_time_s > 0 for s in timeline.steps):
        time_ax.set_yscale("log")
    for ax in (loss_ax, time_ax):
        ax.grid(True, alpha=0.3)
        if len(attempts) > 1 and timeline.steps:
            ax.legend(fontsize=8, loc="upper right")
    if not timeline.steps:
        loss_ax.text(0.5, 0.5, "no step rows in metrics.jsonl", ha="center", va="center",
                     transform=loss_ax.transAxes)

    t0 = timeline.start
    for row, attempt in enumerate(attempts):
        for category in COLOURS:
            spans = [(s.start - t0, s.seconds) for s in attempt.segments if s.category == category]
            if spans:
                bar_ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLOURS[category])
    for seg in timeline.idle_segments:
        # Idle time (and a repair wait) belongs to no attempt; drawn on the row of the attempt
        # that crashed.
        row = max((a.index for a in attempts if a.end <= seg.start + 1e-9), default=0)
        bar_ax.broken_barh([(seg.start - t0, seg.seconds)], (row - 0.4, 0.8),
                           facecolors=COLOURS[seg.category], edgecolors="#999999", hatch="//")
    bar_ax.set_yticks(range(len(attempts)), [
        f"attempt {a.index}" + (f" ({a.slices}/{a.full_slices} slices)" if a.degraded else "")
        for a in attempts])
    bar_ax.set_ylim(len(attempts) - 0.5, -0.5)
    bar_ax.set_xlim(0, max(timeline.wall_s, 1e-6))
    bar_ax.set_xlabel("seconds since the first process start")
    bar_ax.set_title(f"goodput {100 * timeline.goodput:.1f}% of {timeline.wall_s:.1f} s wall time",
                     fontsize=10)
    present = [c for c in COLOURS if timeline.seconds.get(c, 0.0) > 0]
    bar_ax.legend(handles=[Patch(facecolor=COLOURS[c], label=LABELS[c]) for c in present],
                  fontsize=8, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    _phase_bars(phase_ax, timeline)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _phase_bars(ax, timeline: Timeline) -> None:
    """One stacked bar per attempt: its time to first step by phase."""
    from matplotlib.patches import Patch

    attempts = timeline.attempts
    for row, attempt in enumerate(attempts):
        if attempt.phases is None:
            continue
        left = 0.0
        for phase in PHASES:
            width = attempt.phases.seconds[phase]
            if width > 0:
                ax.barh(row, width, left=left, height=0.8, color=PHASE_COLOURS[phase])
                left += width
        total = attempt.phases.to_first_step_s
        ax.text(left, row, f" {total:.1f} s" if total is not None else " no step",
                va="center", fontsize=8)
    ax.set_yticks(range(len(attempts)), [f"attempt {a.index}" for a in attempts])
    ax.set_ylim(len(attempts) - 0.5, -0.5)
    ax.set_xlabel("seconds from the attempt's start to its first step")
    ax.set_title("time to first step by phase", fontsize=10)
    present = [p for p in PHASES
               if any(a.phases is not None and a.phases.seconds[p] > 0 for a in attempts)]
    if present:
        ax.legend(handles=[Patch(facecolor=PHASE_COLOURS[p], label=PHASE_LABELS[p])
                           for p in present],
                  fontsize=8, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
