"""Byte units: every size option and every printed size is in MiB (2**20 bytes).

Names carry the unit: ``*_bytes`` in code, ``*_mib`` in options (``max_body_mib``,
``memory_budget_mib``, ``workspace_mib``); ``format_mib`` prints sizes for people.
"""

from __future__ import annotations

MIB = 1 << 20


def mib_to_bytes(mib: float) -> int:
    """``mib`` MiB in bytes (rounded to a whole byte)."""
    return round(mib * MIB)


def format_mib(n_bytes: float | None) -> str:
    """``1234567`` -> ``"1.2 MiB"`` (thousands separated); ``None`` -> ``"-"``."""
    return "-" if n_bytes is None else f"{n_bytes / MIB:,.1f} MiB"
