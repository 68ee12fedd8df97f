"""Plug-in modules for the runner tests (registered in GROUP_PLUGINS by monkeypatching).

Group ``fake`` holds one array ``x`` = arange(4) int32. ``check_fake`` passes when it is there,
``rebuild_fake`` rebuilds it, ``verify_fake`` returns one passing row. The ``boom`` functions
raise, ``noisy`` warns, ``wrong`` rebuilds something else.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from bevcompile.rig.config import RigConfig
from bevcompile.store.plugins import Check, CheckContext, VerifyRow

FAKE_ARRAY = np.arange(4, dtype=np.int32)


def check_fake(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    present = "x" in arrays and np.array_equal(arrays["x"], FAKE_ARRAY)
    return [Check("fake_content", "fake/x", present, "x == arange(4)" if present else "x missing or wrong")]


def rebuild_fake(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {"x": FAKE_ARRAY.copy()}


def verify_fake(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[VerifyRow]:
    assert ctx.features is not None and ctx.depth_probs is not None
    return [VerifyRow("fake/x", "all", 0.0, 0.0, float("inf"), "max_abs <= 0", True, f"features {ctx.features.shape}")]


def check_boom(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    raise RuntimeError("plug-in exploded\nwith a second line")


def verify_boom(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[VerifyRow]:
    raise KeyError("no such thing")


def rebuild_boom(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    raise ZeroDivisionError("division by zero")


def check_noisy(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    warnings.warn("something odd\nover two lines", RuntimeWarning, stacklevel=1)
    return [Check("noisy", "noisy/", True, "fine")]


def check_wrong(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    return [Check("wrong", "wrong/", True, "fine")]


def rebuild_wrong(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {"x": FAKE_ARRAY[::-1].copy(), "y": FAKE_ARRAY.copy()}


def check_oom(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    raise MemoryError("Unable to allocate 338. MiB")


def verify_oom(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[VerifyRow]:
    raise MemoryError("Unable to allocate 338. MiB")


def rebuild_oom(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    raise MemoryError("Unable to allocate 338. MiB")
