"""The monitor's figure: one interactive plotly panel per group of metrics (:data:`homerlhf.app.monitor.PANELS`),
three to a row, each with its own legend whole under it (the lines' human names, and the panel's note).

Plotly draws in the browser (hover for values, drag to zoom, double-click to reset) from the plotly.js that
Gradio serves itself, so it works offline; its text stays SVG text. The layout is laid out here in pixels — a
row is its title, its plot, its axis and the height of its longest legend — so no legend overlaps another
panel or is cut, whatever a panel holds. Ticks are plain numbers; the x axis counts whole iterations (or steps).
"""

from __future__ import annotations

import math
import textwrap
from typing import Callable, Sequence

from homerlhf.app.monitor_reference import NAME as REFERENCE  # a line named so is a reference run's: dashed grey

COLUMNS = 3
TITLE_PX, PLOT_PX, AXIS_PX, ITEM_PX, GAP_PX = 30, 190, 42, 19, 18  # a row's bands, top to bottom
MARGIN = {"l": 56, "r": 24, "t": 46, "b": 8}
X_GAP = 0.075  # between columns, a fraction of the width: room for the next panel's tick labels
DASHES = ["solid", "dash", "dashdot", "dot"]
SYMBOLS = ["circle", "square", "triangle-up", "diamond", "triangle-down", "cross"]
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
REFERENCE_COLOR, REFERENCE_DASHES = "#8c8c8c", ["dash", "dot"]
FOOT_CHARS = 180  # the note under the whole figure wraps at this width
NOTE_CHARS = 58  # a note under a legend wraps at this width (a column at 1400 px)
TITLE_CHARS = 44  # a panel title wraps at this width, so it stays over its own panel


def nice_step(span: float) -> int:
    """A whole tick step for ``span`` iterations: every one up to 10, else 1, 2 or 5 x 10^k for ~8 ticks."""
    if span <= 10:
        return 1
    raw = span / 8
    power = 10 ** math.floor(math.log10(raw))
    return int(next(m * power for m in (1, 2, 5, 10) if m * power >= raw))


def _legend_items(entry) -> int:
    title, lines, note = entry
    return len(lines) + (len(textwrap.wrap(note, NOTE_CHARS)) if note else 0)


def panel_figure(panels: list[tuple[str, list[tuple[str, str, list, list]], str]], heading: str, x_title: str,
                 foot: str = ""):
    """The figure of ``panels``: (title, lines, note) each, a line being (metric key, legend name, xs, ys);
    ``foot``: a note under the whole figure."""
    import plotly.graph_objects as go

    fig = go.Figure()
    rows = [panels[i:i + COLUMNS] for i in range(0, len(panels), COLUMNS)]
    bands = [TITLE_PX + PLOT_PX + AXIS_PX + max(_legend_items(p) for p in row) * ITEM_PX + GAP_PX for row in rows]
    foot_lines = textwrap.wrap(foot, FOOT_CHARS)
    height = (sum(bands) or PLOT_PX) + len(foot_lines) * ITEM_PX
    width = (1 - X_GAP * (COLUMNS - 1)) / COLUMNS
    top = height
    layout = {}
    for r, row in enumerate(rows):
        plot_top, plot_bottom = top - TITLE_PX, top - TITLE_PX - PLOT_PX
        for c, (title, lines, note) in enumerate(row):
            n = r * COLUMNS + c + 1
            x0 = c * (width + X_GAP)
            _panel(fig, layout, n, (x0, x0 + width), (plot_bottom / height, plot_top / height), title, lines, note,
                   x_title, (plot_bottom - AXIS_PX) / height)
        top -= bands[r]
    fig.update_layout(
        height=height + MARGIN["t"] + MARGIN["b"], margin=MARGIN, template="plotly_white", showlegend=True,
        title={"text": heading, "x": 0, "xanchor": "left", "font": {"size": 14}}, font={"size": 12},
        hovermode="closest", **layout)
    if foot_lines:
        fig.add_annotation(text="<br>".join(foot_lines), showarrow=False, x=0, y=0, xref="paper", yref="paper",
                           xanchor="left", yanchor="bottom", align="left", font={"size": 11, "color": "#555"})
    if not panels:
        fig.add_annotation(text="nothing logged yet", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    return fig


def _panel(fig, layout: dict, n: int, x_domain, y_domain, title: str, lines, note: str, x_title: str,
           legend_y: float) -> None:
    """Panel ``n``: its axes in their domains, its lines, its title above and its legend (and note) under it."""
    import plotly.graph_objects as go

    suffix = "" if n == 1 else str(n)
    xs_all = [x for _, _, xs, _ in lines for x in xs]
    ys_all = [y for _, _, _, ys in lines for y in ys]
    xaxis = {"domain": list(x_domain), "anchor": f"y{suffix}", "title": {"text": x_title, "standoff": 4},
             "tickformat": "d", "zeroline": False, "showline": True, "linecolor": "#999", "mirror": True}
    if xs_all:
        low, high = min(xs_all), max(xs_all)
        xaxis.update(range=[low - 0.5, high + 0.5], tick0=low, dtick=nice_step(high - low))
    yaxis = {"domain": list(y_domain), "anchor": f"x{suffix}", "exponentformat": "none", "zeroline": False,
             "showline": True, "linecolor": "#999", "mirror": True, "tickformat": "~r"}
    if ys_all and max(ys_all) - min(ys_all) < 1e-9:  # one point, or a flat line: a readable range around it
        pad = max(abs(ys_all[0]) * 0.1, 1e-3)
        yaxis["range"] = [ys_all[0] - pad, ys_all[0] + pad]
    layout[f"xaxis{suffix}"], layout[f"yaxis{suffix}"] = xaxis, yaxis
    legend = f"legend{suffix}"
    layout[legend] = {"x": x_domain[0], "y": legend_y, "xanchor": "left", "yanchor": "top", "orientation": "v",
                      "bgcolor": "rgba(0,0,0,0)", "font": {"size": 11}, "tracegroupgap": 0, "itemclick": "toggle",
                      "title": {"text": "<br>".join(textwrap.wrap(note, NOTE_CHARS)), "side": "top", "font": {"size": 10}}
                      if note else {"text": ""}}
    fig.add_annotation(text="<br>".join(f"<b>{part}</b>" for part in textwrap.wrap(title, TITLE_CHARS)), x=(x_domain[0] + x_domain[1]) / 2, y=y_domain[1], xref="paper",
                       yref="paper", xanchor="center", yanchor="bottom", showarrow=False, font={"size": 13})
    own = [line for line in lines if not line[1].startswith(REFERENCE)]
    for i, (key, name, xs, ys) in enumerate(own):
        # Dashes and markers differ, so two metrics that agree (score and reward at KL 0) both show.
        fig.add_trace(go.Scatter(
            x=xs, y=ys, name=name, mode="lines+markers", xaxis=f"x{suffix}", yaxis=f"y{suffix}", legend=legend,
            line={"dash": DASHES[i % len(DASHES)], "color": COLORS[i % len(COLORS)], "width": 1.6},
            marker={"symbol": SYMBOLS[i % len(SYMBOLS)], "size": 6}, meta=key,
            hovertemplate=f"{name}<br>{x_title} %{{x}}: %{{y:.6~g}}<extra></extra>"))
    for i, (key, name, xs, ys) in enumerate(line for line in lines if line[1].startswith(REFERENCE)):
        fig.add_trace(go.Scatter(  # a reference run's: behind the run's own lines, no markers
            x=xs, y=ys, name=name, mode="lines", xaxis=f"x{suffix}", yaxis=f"y{suffix}", legend=legend,
            line={"dash": REFERENCE_DASHES[i % len(REFERENCE_DASHES)], "color": REFERENCE_COLOR, "width": 1.4},
            meta=key, hovertemplate=f"{name}<br>{x_title} %{{x}}: %{{y:.6~g}}<extra></extra>"))


def lines_of(keys: Sequence[str], rows: Sequence[dict], name: Callable[[str], str],
             series: Callable) -> list[tuple[str, str, list, list]]:
    """(key, legend name, xs, ys) of each key that has a value in ``rows``."""
    out = []
    for key in keys:
        xs, ys = series(rows, key)
        if xs:
            out.append((key, name(key), xs, ys))
    return out


def figure_texts(fig) -> list[str]:
    """The text a browser shows of ``fig``: its heading, panel titles, legend names and notes (tests, captions)."""
    import re

    layout = fig.to_plotly_json()["layout"]
    texts = [layout.get("title", {}).get("text", "")]
    texts += [re.sub(r"</?b>", "", a["text"]).replace("<br>", " ") for a in layout.get("annotations", [])]
    texts += [trace.name for trace in fig.data]
    for key, value in layout.items():
        if key.startswith("legend") and isinstance(value, dict) and value.get("title", {}).get("text"):
            texts.append(value["title"]["text"].replace("<br>", " "))
    return [t for t in texts if t]


def heading(n_rows: int, unit: str) -> str:
    return f"{n_rows} {unit}(s) logged"
