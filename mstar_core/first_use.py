"""Slow first uses, said out loud: a kernel library that compiles a kernel family the first time it
is used (FlashInfer's JIT: 20-120 s on an H200) otherwise looks like a hang.

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
from typing import Any, Protocol

log = logging.getLogger("mstar.first_use")


class Listener(Protocol):
    """Told when a first use starts (returning a handle of its own choosing) and when it ends:
    ``ok`` False for a call that raised; ``detail`` as logged. First uses may overlap (threads)."""

    def start(self, what: str) -> Any: ...

    def end(self, handle: Any, what: str, seconds: float, ok: bool, detail: str | None) -> None: ...


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
    handles = [(li, li.start(what)) for li in listeners]
    t0 = time.perf_counter()
    ok = False
    info: str | None = None
    try:
        yield
        ok = True
        _seen.add(key)
        if detail is not None:
            try:
                info = detail()
            except Exception as e:  # what was built is a nicety: never fail the call for it
                lg.debug("%s: could not tell what was built (%s: %s)", what, type(e).__name__, e)
    finally:
        seconds = time.perf_counter() - t0
        if ok:
            lg.info("%s: ready in %.1f s%s", what, seconds, f" ({info})" if info else "")
        for li, handle in handles:
            li.end(handle, what, seconds, ok, info)

