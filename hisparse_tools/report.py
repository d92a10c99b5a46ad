"""Readable tables and optional PNG plots for the CLI.

matplotlib is optional: :func:`require_matplotlib` raises a clear error naming the
install command when ``--plot`` is asked for and it is missing.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from .exit_codes import MissingDependency


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    num = [all(isinstance(r[i], (int, float)) for r in rows) if rows else False
           for i in range(len(headers))]

    def line(vals):
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(vals, widths, num)).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


class PlotUnavailable(MissingDependency):
    """--plot was asked for but matplotlib is not installed."""


def require_matplotlib():
    """Return ``matplotlib.pyplot`` (Agg backend) or raise :class:`PlotUnavailable`."""
    try:  # matplotlib is optional (the [tools] extra): imported only when a plot is asked for
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed; `pip install matplotlib` "
            "(or `pip install hisparse[tools]`), or run without --plot") from None
    return plt


def plot_stress(directory: str, *, hit_rate: Sequence[float], optimal: Sequence[float] | None,
                step_ms: Sequence[float]) -> list[str]:
    """Write hit_rate.png (per step, vs the Belady optimum) and step_time.png; return paths."""
    plt = require_matplotlib()
    os.makedirs(directory, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(len(hit_rate)), hit_rate, label="cache (LRU)")
    if optimal is not None:
        ax.plot(range(len(optimal)), optimal, "--", label="Belady optimum (offline)")
    ax.set_xlabel("decode step")
    ax.set_ylabel("hit rate (unique rows)")
    ax.set_ylim(0, 1.02)
    ax.legend()
    ax.set_title("hisparse stress: hit rate per step")
    p = os.path.join(directory, "hit_rate.png")
    fig.tight_layout()
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(list(step_ms), bins=min(50, max(5, len(step_ms) // 2)))
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("steps")
    ax.set_title("hisparse stress: step-time distribution")
    p = os.path.join(directory, "step_time.png")
    fig.tight_layout()
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths
