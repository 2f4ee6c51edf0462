"""Report figures: matplotlib, rendered to SVG with text as paths.

Why matplotlib → SVG: the report must be one file that opens offline. An SVG with
glyphs drawn as paths needs no fonts, no JavaScript and no network, stays small
(tens of kB a figure, vs ~4 MB of inlined plotly.js), scales crisply, and is
deterministic (fixed ``svg.hashsalt``, no date). Each figure is embedded as a
``data:image/svg+xml`` image so the ids inside different SVGs cannot collide.
Figures are built on ``matplotlib.figure.Figure`` directly: no pyplot global state.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from ..display import printable

if TYPE_CHECKING:  # matplotlib itself is imported when a figure is drawn (the CLI starts fast)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    from matplotlib.typing import RcKeyType

__all__ = ["FIGURES", "render_figures"]

STATUS_COLORS = {"ok": "#2e7d32", "flagged": "#f9a825", "rejected": "#c62828"}
_ACCENT = "#1565c0"
_RC: dict[RcKeyType, Any] = {
    "text.parse_math": False,  # names from the API are text: "$\\foo{$" is not a formula
    "svg.fonttype": "path",
    "svg.hashsalt": "tokenbridge",
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
}


#: A figure's builder: the report's data -> the figure, or None where its section has no data.
_Builder = Callable[[dict[str, Any]], "Figure | None"]


def render_figures(data: dict[str, Any]) -> dict[str, str | None]:
    """Figure name -> ``data:`` URI of its SVG, or None where its section has no data."""
    import matplotlib

    out: dict[str, str | None] = {}
    with matplotlib.rc_context(_RC):
        for name, build in FIGURES.items():
            fig = build(data)
            out[name] = None if fig is None else _data_uri(fig)
    return out


def _figure(width: float = 7.5, height: float = 3.0) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _integer_ticks() -> MaxNLocator:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _data_uri(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _lengths(data: dict[str, Any]) -> Figure | None:
    lengths = data["lengths"]
    if not lengths["prompt"].get("count"):
        return None
    fig = _figure()
    axes = fig.subplots(1, 2)
    for ax, side in zip(axes, ("prompt", "completion")):
        hist = lengths[f"{side}_hist"]
        edges, counts = hist["edges"], hist["counts"]
        ax.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges, edges[1:])], align="edge",
               color=_ACCENT, edgecolor="white", linewidth=0.4)
        ax.set_title(f"{side} tokens (p50 {lengths[side]['p50']:.0f}, max {lengths[side]['max']})")
        ax.set_xlabel("tokens")
        ax.set_ylabel("rows")
        ax.yaxis.set_major_locator(_integer_ticks())
    return fig


def _status(key: str, label: str) -> _Builder:
    def build(data: dict[str, Any]) -> Figure | None:
        groups = data[key]
        if not groups:
            return None
        keys = list(groups)
        names = [printable(n) for n in keys]
        fig = _figure(height=max(1.6, 0.8 + 0.32 * len(names)))
        ax = fig.subplots()
        left = [0] * len(names)
        for status, color in STATUS_COLORS.items():
            values = [groups[n]["status"][status] for n in keys]
            ax.barh(names, values, left=left, color=color, label=status)
            left = [a + b for a, b in zip(left, values)]
        ax.invert_yaxis()
        ax.set_xlabel("rows")
        ax.set_title(f"status per {label}")
        ax.xaxis.set_major_locator(_integer_ticks())
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        return fig

    return build


def _findings(data: dict[str, Any]) -> Figure | None:
    codes = list(data["findings"].items())[:20]
    if not codes:
        return None
    fig = _figure(height=max(1.6, 0.8 + 0.28 * len(codes)))
    ax = fig.subplots()
    ax.barh([printable(c) for c, _ in codes], [n for _, n in codes], color=_ACCENT)
    ax.invert_yaxis()
    ax.set_xlabel("rows with the finding")
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.set_title("finding codes (all rows)")
    return fig


def _parity(data: dict[str, Any]) -> Figure | None:
    parity = data["usage_parity"]
    if parity is None:
        return None
    fig = _figure()
    axes = fig.subplots(1, 2)
    for ax, side in zip(axes, ("prompt", "completion")):
        values = parity[f"{side}_values"]
        stats = parity[side]
        ax.bar(list(values), list(values.values()),
               color=[STATUS_COLORS["ok"] if k == "0" else STATUS_COLORS["rejected"] for k in values])
        exact = f"{stats['exact_share']:.1%} exact" if stats.get("count") else "no usage"
        ax.set_title(f"{side}: usage − ours ({exact})")
        ax.set_xlabel("token delta")
        ax.set_ylabel("exchanges")
        ax.yaxis.set_major_locator(_integer_ticks())
        ax.tick_params(axis="x", labelrotation=45 if len(values) > 8 else 0)
    return fig


def _timeline(data: dict[str, Any]) -> dict[str, Any] | None:
    ex = data.get("exchanges")
    return None if not ex or not ex.get("timeline") else ex["timeline"]


def _unit(duration_s: float) -> tuple[float, str]:
    if duration_s >= 2 * 3600:
        return 3600.0, "hours"
    if duration_s >= 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


def _cost(data: dict[str, Any]) -> Figure | None:
    tl = _timeline(data)
    if tl is None or data["exchanges"].get("cost_total") is None:
        return None
    scale, unit = _unit(tl["duration_s"])
    fig = _figure()
    ax = fig.subplots()
    xs = [p[0] / scale for p in tl["cumulative_cost"]]
    ys = [p[1] for p in tl["cumulative_cost"]]
    ax.plot(xs, ys, color=_ACCENT, drawstyle="steps-post")
    ax.set_xlabel(f"{unit} since the first request")
    ax.set_ylabel("cumulative cost (USD)")
    ax.set_title(f"cost over time (total ${ys[-1]:.4f})")
    return fig


def _throughput(data: dict[str, Any]) -> Figure | None:
    tl = _timeline(data)
    if tl is None:
        return None
    scale, unit = _unit(tl["duration_s"])
    width = tl["bin_s"]
    xs = [b["start_s"] / scale for b in tl["bins"]]
    fig = _figure()
    ax = fig.subplots()
    ax.bar(xs, [b["completion_tokens"] / width for b in tl["bins"]], width=width / scale, align="edge",
           color=_ACCENT, label="completion tokens/s")
    ax.set_xlabel(f"{unit} since the first request")
    ax.set_ylabel("completion tokens / s")
    twin = ax.twinx()
    twin.plot([x + width / scale / 2 for x in xs], [b["requests"] * 60 / width for b in tl["bins"]],
              color=STATUS_COLORS["rejected"], marker="o", markersize=2.5, linewidth=1, label="requests/min")
    twin.set_ylabel("requests / min")
    twin.grid(False)
    ax.set_title(f"throughput over time ({width:g} s bins)")
    return fig


FIGURES: dict[str, _Builder] = {
    "lengths": _lengths,
    "status_provider": _status("by_provider", "provider"),
    "status_dataset": _status("by_dataset", "dataset"),
    "findings": _findings,
    "parity": _parity,
    "cost": _cost,
    "throughput": _throughput,
}
