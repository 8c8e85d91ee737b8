"""The training configuration every member of a run shares, compared field by field and as a digest.

A run's members must train the same model with the same hyper-parameters. The full summary (a small
nested dict) travels in the ``hello`` handshake and in the start records, where a difference is
reported field by field; its digest travels in every stage advert, so that members never admit a
peer that trains something else into a schedule epoch, whoever that peer joined through.
"""

from __future__ import annotations

import hashlib
import json
import reprlib
from typing import List, Optional

__all__ = ["summary_differences", "summary_digest", "MAX_SHOWN_VALUE_CHARS"]

#: A value longer than this is cut in a difference line: a peer's summary is untrusted input, and one
#: error line must stay readable.
MAX_SHOWN_VALUE_CHARS = 60


#: How a peer's value is shown: a few levels deep at most (a deeply nested value must not recurse).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist = 3, 8, 8
_REPR.maxstring = _REPR.maxother = MAX_SHOWN_VALUE_CHARS


def _shown(value: object) -> str:
    text = _REPR.repr(value)
    return text if len(text) <= MAX_SHOWN_VALUE_CHARS else text[:MAX_SHOWN_VALUE_CHARS] + "..."


def summary_differences(mine: dict, theirs: dict, prefix: str = "") -> List[str]:
    """``["optim.lr: 0.001 here, 0.003 there", ...]`` (nested dicts flattened). Recursion follows
    only keys where *both* sides hold a dict, so a deeply nested hostile ``theirs`` cannot make it
    deeper than ``mine``."""
    if not isinstance(theirs, dict):
        return [f"{prefix or 'configuration'}: a summary here, {_shown(theirs)} there"]
    out = []
    for k in sorted(set(mine) | set(theirs), key=str):
        a, b = mine.get(k), theirs.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(summary_differences(a, b, f"{prefix}{k}."))
        elif a != b and not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)):
            out.append(f"{prefix}{str(k)[:MAX_SHOWN_VALUE_CHARS]}: {_shown(a)} here, {_shown(b)} there")
    return out


def summary_digest(summary: Optional[dict]) -> str:
    """A short stable digest of a summary ("" for none: a node that does not train). Lists and
    tuples hash alike, as :func:`summary_differences` compares them."""
    if summary is None:
        return ""
    text = json.dumps(summary, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
