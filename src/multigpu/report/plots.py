"""matplotlib for the reports (a study's, one run's): imported on first use, drawn off-screen, saved as PNG."""

from __future__ import annotations

import io
from typing import Any

from ..errors import UsageError


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display); one line when the report extra is missing."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("reports need matplotlib; pip install 'multigpu[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def one_point(xs: list) -> dict[str, Any]:
    """A line of one point draws nothing: mark it."""
    return {"marker": "o"} if len(xs) == 1 else {}


def png(fig) -> bytes:
    """The figure as PNG bytes, closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    pyplot().close(fig)
    return buf.getvalue()
