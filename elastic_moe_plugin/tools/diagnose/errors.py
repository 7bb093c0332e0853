"""The one exception type of ``elastic-moe diagnose``."""

from __future__ import annotations


class DiagnosticsError(ValueError):
    """A bad input to ``elastic-moe diagnose`` (the CLI prints it and exits with status 2)."""
