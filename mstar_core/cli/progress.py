"""The CLI's progress line for slow first uses (:mod:`mstar_core.first_use`): silent for the
first second (a cached kernel loads in less), then a line on stderr that counts the seconds --
rewritten in place on a terminal, one line every ``every`` seconds otherwise -- and the time taken."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    def __init__(self, stream: TextIO | None = None, delay: float = 1.0, every: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.delay = delay
        self.every = every if every is not None else (1.0 if self.tty else 10.0)
        self._done: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._shown = False

    def start(self, what: str) -> None:
        self._done = threading.Event()
        self._shown = False
        t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._tick, args=(what, t0, self._done), daemon=True)
        self._thread.start()

    def _tick(self, what: str, t0: float, done: threading.Event) -> None:
        wait = self.delay
        while not done.wait(wait):
            s = time.perf_counter() - t0
            line = f"mstar: preparing {what} (first use; it may be compiling) ... {s:.0f} s"
            self.stream.write(f"\r{line}" if self.tty else f"{line}\n")
            self.stream.flush()
            self._shown = True
            wait = self.every

    def end(self, what: str, seconds: float, detail: str | None) -> None:
        if self._done is not None:
            self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self._shown:
            tail = f" ({detail})" if detail else ""
            self.stream.write(f"{chr(13) if self.tty else ''}mstar: {what}: ready in {seconds:.1f} s{tail}\n")
            self.stream.flush()
        self._done = self._thread = None
