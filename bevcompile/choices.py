"""Enumerated option values, spelled in any case: the one rule every entry point follows.

``bevcompile grid --order CACHE``, ``matrix --mode FRUSTUM`` and a fleet manifest's
``matrix: {mode: Frustum}`` all mean the canonical lower-case value, which is what the library,
the store's ``build_options`` (and so the store bytes) and ``--json`` record.

May import: nothing of bevcompile (every package may use it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload


@overload
def canonical_choice(value: str, allowed: Sequence[str | None]) -> str: ...
@overload
def canonical_choice(value: None, allowed: Sequence[str | None]) -> None: ...
def canonical_choice(value: str | None, allowed: Sequence[str | None]) -> str | None:
    """The canonical (lower-case) spelling of an enumerated option value given in any case.

    Every command accepts ``--mode FRUSTUM`` as ``--mode frustum``, so the library, the store's
    ``build_options`` and therefore the store bytes only ever see the canonical name. A value that
    matches nothing is returned unchanged, so the library's one-line error quotes what was typed.
    """
    if value is None:
        return None
    lowered = value.lower()
    return lowered if lowered in allowed else value
