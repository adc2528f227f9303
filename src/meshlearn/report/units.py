"""Human-readable numbers and durations shared by the progress line, tables and plots.

Kept in one place so "5.3k tok/s" means the same thing in the console and in the report.
"""

from __future__ import annotations

import math

_SUFFIXES = (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12))


def format_count(value: float) -> str:
    """Format a count or rate with a k/M/G/T suffix: 950 -> '950', 5321 -> '5.3k'.

    The unit is chosen after rounding, so 999_960 becomes '1.0M' rather than '1000.0k'.
    """
    if not math.isfinite(value):
        return "?"
    sign = "-" if value < 0 else ""
    v = abs(value)
    if round(v) < 1000:
        return f"{sign}{v:.0f}"
    for i, (suffix, scale) in enumerate(_SUFFIXES):
        scaled = v / scale
        if round(scaled, 1) < 1000 or i == len(_SUFFIXES) - 1:
            return f"{sign}{scaled:.1f}{suffix}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_amount(value: float) -> str:
    """Format a per-token quantity exactly while short: 512 -> '512.0', 2048 -> '2,048'.

    Bytes per token differ between configurations by small factors, so rounding 2048 to
    '2.0k' would hide differences; only values of a million or more get a suffix.
    """
    if not math.isfinite(value):
        return "?"
    if abs(value) < 1000:
        return f"{value:.1f}"
    return f"{value:,.0f}" if abs(value) < 1e6 else format_count(value)


def format_duration(seconds: float | None) -> str:
    """Format seconds compactly: 42 -> '42s', 72 -> '1m12s', 7380 -> '2h03m', 93600 -> '1d02h'.

    Unknown, negative or infinite durations become '?' rather than a misleading number.
    """
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def time_axis_unit(max_seconds: float) -> tuple[str, float]:
    """Pick a plot unit for a time axis spanning ``max_seconds``: (name, seconds per unit)."""
    if max_seconds < 120:
        return "s", 1.0
    if max_seconds < 2 * 3600:
        return "min", 60.0
    if max_seconds < 48 * 3600:
        return "h", 3600.0
    return "days", 86400.0


def as_number(value: object) -> float | None:
    """Return ``value`` as a finite float, or None for missing, non-numeric, bool or NaN/inf.

    Metrics come from JSON written by a possibly-crashing process, so nothing is trusted.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None
