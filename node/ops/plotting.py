"""Optional charts: matplotlib is an extra (``plot``), so every chart goes through :func:`load_pyplot`."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Optional

__all__ = ["load_pyplot"]

logger = logging.getLogger(__name__)


def load_pyplot(what: str) -> Optional[ModuleType]:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display on servers or in CI), or
    ``None`` with one warning naming the chart that is skipped (``what``) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; no %s", what)
        return None
    return plt
