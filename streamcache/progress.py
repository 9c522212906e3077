"""Progress of long commands: a live bar on a terminal, whole lines in a log.

On a terminal one line is redrawn in place (``\\r``, a bar when the total is known). Anywhere
else (a log file, a pipe, CI) each report is a complete line, written less often, so reports
never run together. No dependency: this is the one progress display of the CLI.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24


class ProgressLine:
    """Reports the progress of one task to ``stream`` (``None``: silent).

    Args:
        stream: where to write, usually ``sys.stderr``.
        label: what is progressing (``"streamcache"``, ``"converting"``).
        total: the count at which the task is done, when known (draws a bar on a terminal).
        unit: what the count counts (``"steps"``).
        tty_interval_s / log_interval_s: least time between two reports on a terminal / in
            a log.
        clock: seconds, monotonic (a parameter so that tests need not sleep).

    Thread safety: one thread reports.
    """

    def __init__(self, stream: TextIO | None, label: str, *, total: int | None = None,
                 unit: str = "steps", tty_interval_s: float = 0.2, log_interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.label, self.total, self.unit = stream, label, total, unit
        self.tty = bool(stream is not None and _isatty(stream))
        self.interval_s = tty_interval_s if self.tty else log_interval_s
        self._clock = clock
        self._last = clock()
        self._drawn = 0  # characters of the line on screen (terminal only)

    def update(self, done: int, detail: str = "", *, force: bool = False) -> None:
        """Report ``done`` units (and ``detail``) if the interval has passed (or ``force``)."""
        now = self._clock()
        if self.stream is None or (not force and now - self._last < self.interval_s):
            return
        self._last = now
        text = self.render(done, detail)
        if self.tty:
            self.stream.write("\r" + text.ljust(self._drawn))
            self._drawn = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def render(self, done: int, detail: str = "") -> str:
        """The report's text: label, bar (terminal, known total), count, detail."""
        parts = [self.label + ":"]
        if self.total:
            if self.tty:
                filled = min(BAR_WIDTH, BAR_WIDTH * done // self.total)
                parts.append("[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]")
            parts.append(f"{min(done / self.total, 1.0):4.0%} {done:,}/{self.total:,} {self.unit}")
        else:
            parts.append(f"{done:,} {self.unit}")
        if detail:
            parts.append(detail)
        return " ".join(parts)

    def close(self) -> None:
        """End the terminal line (a log needs nothing: every report is a whole line)."""
        if self.stream is not None and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


__all__ = ["ProgressLine"]
