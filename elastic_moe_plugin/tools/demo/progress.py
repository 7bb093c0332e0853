"""The training progress bar: one line per run on stderr (live on a TTY, only the final line otherwise)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr: live on a TTY, only the final line otherwise."""

    def __init__(self, label: str, total: int, stream=None, width: int = 24) -> None:
        self.label, self.total, self.width = label, total, width
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.last_draw = 0.0

    def _line(self, step: int, tokens: int, loss: float) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        filled = int(self.width * step / max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        return (
            f"{self.label:>8} [{bar}] {step}/{self.total} steps  {tokens / elapsed:,.0f} tok/s  "
            f"loss {loss:.3f}  {elapsed:.0f}s"
        )

    def update(self, step: int, tokens: int, loss: float) -> None:
        now = time.perf_counter()
        if self.live and (now - self.last_draw > 0.1 or step == self.total):
            self.last_draw = now
            self.stream.write("\r" + self._line(step, tokens, loss) + "\033[K")
            self.stream.flush()

    def close(self, step: int, tokens: int, loss: float) -> None:
        line = self._line(step, tokens, loss)
        self.stream.write(("\r" + line + "\033[K\n") if self.live else line + "\n")
        self.stream.flush()
