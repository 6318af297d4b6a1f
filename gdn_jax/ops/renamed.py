"""Public names that changed, and the one warning an old name gives: a ``DeprecationWarning``
the first time a process uses it, then silence (a loop that calls an old op once a step is
not flooded). The old names keep working as before.
"""

from __future__ import annotations

import warnings

# The old names that have warned in this process (a test empties it to see the warning).
WARNED: set[str] = set()


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn, once per process for ``old``, that ``old`` is deprecated for ``new``;
    ``stacklevel`` 3 points at the caller of the function that calls this."""
    if old in WARNED:
        return
    WARNED.add(old)
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel)
