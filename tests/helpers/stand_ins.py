"""Stand-ins for the parts a test is not about."""

from __future__ import annotations

from typing import Any


class Cursor:
    """Stand-in for the StreamLoader in checkpoint tests: a global, JSON-able state that is
    identical on every rank (``global_state``), saved once by the Checkpointer."""

    global_state = True

    def __init__(self, samples_consumed: int = 0) -> None:
        self.samples_consumed = samples_consumed

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "samples_consumed": self.samples_consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples_consumed = state_dict["samples_consumed"]
