"""The tests' time limits (not a test module itself): a limit written for a quiet machine, scaled by
how busy this one is, so that a slow run on a loaded machine is not a failure and a hang still is.

``scaled_timeout(150)`` is 150 s on an idle machine and 600 s under a load of 8 on 2 cores: the
seconds times ``HOOKCLI_TEST_TIMEOUT_SCALE`` when it is set (a CI runner known to be slow), else times
the load per core (``os.getloadavg()``, the last minute's, over the cores this process may use),
never less than 1. Every subprocess, thread join and torchrun launch in tests/ takes its limit from
here (tests/test_timeouts.py checks that no fixed ``timeout=`` is left).
"""

from __future__ import annotations

import os

#: The environment variable that sets the factor outright.
SCALE_ENV = "HOOKCLI_TEST_TIMEOUT_SCALE"


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def timeout_scale() -> float:
    """How many times longer than on a quiet machine a test may take now (1 or more)."""
    given = os.environ.get(SCALE_ENV, "").strip()
    if given:
        try:
            return max(1.0, float(given))
        except ValueError:
            raise ValueError(f"{SCALE_ENV} must be a number such as 4, got {given!r}") from None
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return 1.0
    return max(1.0, load / _cores())


def scaled_timeout(seconds: float) -> float:
    """``seconds`` (the limit on a quiet machine) scaled by :func:`timeout_scale`."""
    return seconds * timeout_scale()
