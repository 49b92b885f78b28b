"""The CLI's progress line for slow first uses (:mod:`mstar_core.first_use`): silent for the
first second (a cached kernel loads in less), then a line on stderr that counts the seconds --
rewritten in place on a terminal, one line every ``every`` seconds otherwise -- and the time taken
(or that it failed). Each first use has its own ticker, so overlapping ones (threads) cannot
leave one running."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

CLEAR = "\r\033[K"  # back to the start of the line and clear it (a terminal only)


@dataclass
class _Tick:
    done: threading.Event = field(default_factory=threading.Event)
    shown: bool = False
    thread: threading.Thread | None = None


class Progress:
    def __init__(self, stream: TextIO | None = None, delay: float = 1.0, every: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.delay = delay
        self.every = every if every is not None else (1.0 if self.tty else 10.0)
        self._write_lock = threading.Lock()

    def _write(self, text: str) -> None:
        with self._write_lock:
            self.stream.write(text)
            self.stream.flush()

    def start(self, what: str) -> _Tick:
        tick = _Tick()
        tick.thread = threading.Thread(target=self._run, args=(what, time.perf_counter(), tick), daemon=True)
        tick.thread.start()
        return tick

    def _run(self, what: str, t0: float, tick: _Tick) -> None:
        wait = self.delay
        while not tick.done.wait(wait):
            line = f"mstar: preparing {what} (first use; it may be compiling) ... {time.perf_counter() - t0:.0f} s"
            self._write(f"{CLEAR}{line}" if self.tty else f"{line}\n")
            tick.shown = True
            wait = self.every

    def end(self, tick: _Tick, what: str, seconds: float, ok: bool, detail: str | None) -> None:
        tick.done.set()
        if tick.thread is not None:
            tick.thread.join()
        if tick.shown:
            if ok:
                line = f"mstar: {what}: ready in {seconds:.1f} s" + (f" ({detail})" if detail else "")
            else:
                line = f"mstar: {what}: failed after {seconds:.1f} s"
            self._write(f"{CLEAR if self.tty else ''}{line}\n")
