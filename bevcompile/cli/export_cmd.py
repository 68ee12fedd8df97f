"""CLI commands (placeholder: filled in by the owning issue)."""

from __future__ import annotations
