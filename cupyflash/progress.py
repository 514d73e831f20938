"""A dependency-free text progress bar for long command-line jobs (prewarm, autotune)."""
from __future__ import annotations

import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """Counts completed items and draws `label [####....] done/total pct elapsed eta  last item`.

    On a terminal the bar redraws in place; elsewhere (CI logs) it prints a line per 5% step and
    per failure, so logs stay short but show that work is moving.
    """

    WIDTH = 30
    LOG_STEP_PERCENT = 5

    def __init__(self, total: int, stream: TextIO | None, label: str = "") -> None:
        self.total = max(0, total)
        self.stream = stream
        self.label = label
        self.done = 0
        self.failed = 0
        self._start = time.perf_counter()
        self._last_logged_step = -1
        try:
            self._tty = bool(stream is not None and stream.isatty())
        except (AttributeError, ValueError):
            self._tty = False

    def advance(self, item: str = "", failed: bool = False) -> None:
        """Mark one item done (`item` names it on the line)."""
        self.done += 1
        self.failed += int(failed)
        if self.stream is None:
            return
        if self._tty:
            self.stream.write("\r\x1b[K" + self._line(item)[:200])
            self.stream.flush()
            return
        step = (100 * self.done // self.total) // self.LOG_STEP_PERCENT if self.total else 0
        if failed or step != self._last_logged_step or self.done == self.total:
            self._last_logged_step = step
            self.stream.write(self._line(item) + "\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.stream is not None and self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def _line(self, item: str) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.WIDTH))
        elapsed = time.perf_counter() - self._start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        fails = f" {self.failed} failed" if self.failed else ""
        return (f"{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total} "
                f"{100 * frac:5.1f}% {_clock(elapsed)} eta {_clock(eta)}{fails}  {item}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"
