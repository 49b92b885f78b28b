"""Slow first uses, said out loud: a kernel library that compiles a kernel family the first time it
is used (FlashInfer's JIT: 20-100 s on an H200) otherwise looks like a hang.

A backend wraps the call that may compile in :func:`first_use`, keyed by what selects the kernel
(kind, dtype, head dim, variant). The first time a key is seen in the process one INFO line says
what is being prepared and why, listeners (the CLI's progress line) hear of the start and the end,
and a second INFO line gives the time and, where the backend can tell, what was compiled. Every
later use of the key costs one set lookup.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol

log = logging.getLogger("mstar.first_use")


class Listener(Protocol):
    """Told when a first use starts and when it ends (``seconds`` set; ``detail`` as logged)."""

    def start(self, what: str) -> None: ...

    def end(self, what: str, seconds: float, detail: str | None) -> None: ...


_seen: set[Hashable] = set()
_listeners: list[Listener] = []
_lock = threading.Lock()


def add_listener(listener: Listener) -> None:
    with _lock:
        _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def seen(key: Hashable) -> bool:
    return key in _seen


def forget() -> None:
    """Forget every key (tests; a process that cleared the library's cache)."""
    with _lock:
        _seen.clear()


@contextlib.contextmanager
def first_use(
    key: Hashable, what: str, why: str, logger: logging.Logger | None = None,
    detail: Callable[[], str | None] | None = None,
) -> Iterator[None]:
    """Around a call that may compile ``what`` on its first use in this process.

    ``why`` says why it may take long; ``detail`` (called after the call succeeds) says what was
    done, e.g. "compiled 2 modules: ...". A call that fails leaves the key unseen, so the next try
    is announced again.
    """
    if key in _seen:
        yield
        return
    lg = logger or log
    lg.info("%s: first use in this process; %s", what, why)
    with _lock:
        listeners = list(_listeners)
    for li in listeners:
        li.start(what)
    t0 = time.perf_counter()
    ok = False
    info: str | None = None
    try:
        yield
        ok = True
    finally:
        seconds = time.perf_counter() - t0
        if ok:
            _seen.add(key)
            info = detail() if detail is not None else None
            lg.info("%s: ready in %.1f s%s", what, seconds, f" ({info})" if info else "")
        for li in listeners:
            li.end(what, seconds, info if ok else "failed")
