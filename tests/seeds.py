"""Seeds of random test schedules: chosen once, printed, and named in a failure's report.

    from seeds import schedule_seed

    seed = schedule_seed("STREAMCACHE_CRASH_SEED")   # the variable that replays it
    chooser = random.Random(seed)

The seed comes from the variable when it is set, else at random. It is printed at once (pytest
shows a failed test's captured output, also after a timeout) and conftest adds a line
``rerun with STREAMCACHE_CRASH_SEED=<seed>`` to the report of a test that fails, so a run that
hits its timeout still says how to replay it.
"""

from __future__ import annotations

import os
import random

#: (variable, seed) chosen by the test that runs now; conftest clears it before each test.
chosen: list[tuple[str, int]] = []


def schedule_seed(variable: str) -> int:
    """The seed of a random schedule: ``$variable`` when set, else a fresh one."""
    text = os.environ.get(variable)
    seed = int(text) if text else random.randrange(1 << 30)
    chosen.append((variable, seed))
    print(f"random schedule: rerun with {variable}={seed}", flush=True)
    return seed


def replay_line() -> str | None:
    """``rerun with A=1 B=2`` for the seeds the current test chose, or None."""
    if not chosen:
        return None
    return "rerun with " + " ".join(f"{variable}={seed}" for variable, seed in chosen)
