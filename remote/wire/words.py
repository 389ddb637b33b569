"""Sizes in words, both sides: bytes as a person reads them, and a train run's measured memory.

Stdlib only; the laptop imports it as ``specops.wire.units`` to word a train run's status the way the host does.
"""
from __future__ import annotations

GiB = 1024 ** 3
MiB = 1024 ** 2


def human_bytes(n) -> str:
    """``1536 -> '1.5 KiB'``; ``None -> '?'``."""
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"



def ratio(peak, estimate) -> float | None:
    """``peak / estimate`` to 3 decimals; None when either is unknown."""
    return round(peak / estimate, 3) if peak and estimate else None


def usage_line(memory: dict | None) -> str | None:
    """The status's ``memory`` in words, e.g. ``peak 4.8 GiB on GPU 0 (NVIDIA H200), 0.87x the 5.5 GiB
    estimated``; None without one.

    >>> usage_line({"where": "RAM", "peak_bytes": 3 * 2**30, "estimate_bytes": 2 * 2**30, "peak_over_estimate": 1.5})
    'peak 3.0 GiB in RAM, 1.50x the 2.0 GiB estimated'
    """
    if not memory:
        return None
    where = memory.get("where") or "?"
    if not memory.get("peak_bytes"):
        return f"memory not measured ({where}): {memory.get('why') or 'no sample yet'}"
    line = f"peak {human_bytes(memory['peak_bytes'])} {'in' if where == 'RAM' else 'on'} {where}"
    if memory.get("peak_over_estimate") is not None:
        line += f", {memory['peak_over_estimate']:.2f}x the {human_bytes(memory['estimate_bytes'])} estimated"
    else:
        line += " (no estimate to compare with)"
    if memory.get("why"):
        line += f" (sampling stopped early: {memory['why']})"
    return line
