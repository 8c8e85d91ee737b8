"""Plain-text tables for reports: the first column left-aligned (labels), the rest right-aligned
(numbers), a rule under the header, so evaluation and benchmark output lines up in a terminal."""

from __future__ import annotations

from typing import Sequence

__all__ = ["text_table"]


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows[0]`` is the header; every row has as many cells as the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
