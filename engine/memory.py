"""Process memory figures for stats and benchmarks."""

from __future__ import annotations

import sys


def peak_rss_mb() -> float:
    """Peak resident set size of this process, in MiB."""
    if sys.platform != "win32":
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports KiB, macOS bytes
        return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
    import psutil

    return psutil.Process().memory_info().peak_wset / (1024 * 1024)


def rss_mb() -> float:
    """Current resident set size of this process, in MiB."""
    import psutil

    return psutil.Process().memory_info().rss / (1024 * 1024)
