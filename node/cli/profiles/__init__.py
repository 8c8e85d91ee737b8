"""Network profiles shipped with the package (``skippipe plan --profile geo-distributed-12``).

A profile is a location list with pairwise latency (ms) and bandwidth (GiB/s), the JSON that
:meth:`scheduler.cost.LinkProfile.load` reads. :func:`resolve_profile` turns a bare name into the
shipped file; anything that looks like a path (or an existing file) is passed through unchanged.
"""

from __future__ import annotations

import pathlib
from typing import List

__all__ = ["resolve_profile", "shipped_profiles", "PROFILE_DIR"]

PROFILE_DIR = pathlib.Path(__file__).resolve().parent


def shipped_profiles() -> List[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def resolve_profile(name_or_path: str) -> str:
    """``geo-distributed-12`` -> the shipped JSON; a path (existing, or with a / or .json) -> itself."""
    text = str(name_or_path)
    if pathlib.Path(text).expanduser().exists() or "/" in text or text.endswith(".json"):
        return str(pathlib.Path(text).expanduser())
    shipped = PROFILE_DIR / f"{text}.json"
    if shipped.is_file():
        return str(shipped)
    return text  # LinkProfile.load reports "cannot read NAME"; the help lists the shipped names
