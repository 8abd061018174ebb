"""The Gantt picture of one step (matplotlib, part of the ``telemetry`` extra)."""

from __future__ import annotations

from collections.abc import Sequence

from .timeline import Span

__all__ = ["gantt_figure"]


def gantt_figure(spans: Sequence[Span], *, title: str, origin: float):
    """A matplotlib figure of one step: compute spans and each bucket's all-reduce.

    Example:
        >>> fig = gantt_figure([Span("compute", "g0.s0 fwd", 0.0, 0.01)], title="step 0", origin=0.0)
        >>> fig.axes[0].get_title()
        'step 0'
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    spans = [s for s in spans if s.track in ("compute", "comm")]
    rows = sorted({(s.track, s.lane) for s in spans}, key=lambda r: (r[0] != "compute", r[1]))
    span_ms = max([(s.end - origin) * 1e3 for s in spans] + [1e-3])
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.4 * max(1, len(rows))))
    colors = {"compute": "#4C72B0", "comm": "#DD8452"}
    for y, (track, lane) in enumerate(rows):
        for s in spans:
            if (s.track, s.lane) != (track, lane):
                continue
            fwd, eager = s.name.endswith("fwd"), s.name.startswith("eager")
            width, left = (s.end - s.start) * 1e3, (s.start - origin) * 1e3
            ax.barh(
                y,
                width,
                left=left,
                height=0.6,
                color="lightgray" if eager else colors.get(track, "gray"),
                alpha=0.55 if fwd else 0.95,
                edgecolor="black",
                linewidth=0.3,
            )
            if track == "compute" and width >= 0.04 * span_ms:
                label = "eager" if eager else s.name.split(".", 1)[-1]
                ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([t if t == "compute" else f"all-reduce b{lane}" for t, lane in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first forward")
    ax.set_title(title)
    fig.tight_layout()
    return fig
