"""The start-up line: the time from the process's start (what the OS recorded, so the
interpreter's and the imports' time counts) to the end of its first iteration, and the phases it went to.
bench/startup.py parses it (``PHASES``); the time a launcher takes before it starts the process is not
counted.
"""

from __future__ import annotations

import psutil


def process_start() -> float:
    """When this process started (seconds since the epoch), as the OS recorded it."""
    return psutil.Process().create_time()


def line(phases: dict[str, float]) -> str:
    """'time from launch to the end of the first iteration: 12.3 s (imports 4.0 s, ...)'."""
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())
    return f"time from launch to the end of the first iteration: {sum(phases.values()):.1f} s ({parts})"
