"""mstar's exceptions: one base, :class:`MstarError`, so a caller (and the CLI) can tell a
condition mstar reports (bad input, a backend that cannot run here, a failed peer) from a bug.

Each subclass also derives from the built-in type callers already catch (``except ValueError``
keeps working), and says which kind of condition it reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "BackendUnavailable",
    "CommitError",
    "CompileError",
    "ConfigError",
    "InputError",
    "InputIndexError",
    "InputTypeError",
    "MstarError",
    "PluginError",
    "StateError",
    "TensorParallelError",
    "UnknownName",
    "Unsupported",
    "UnsupportedModel",
]


class MstarError(Exception):
    """The base of every error mstar raises on purpose."""


class InputError(MstarError, ValueError):
    """A value passed in is out of range or inconsistent (the message names it and what is allowed)."""


class InputTypeError(MstarError, TypeError):
    """A value passed in has the wrong type (the message names it and the type expected)."""


class InputIndexError(MstarError, IndexError):
    """An index passed in (e.g. ``layer_idx``) is outside what the object holds."""


class Unsupported(MstarError, NotImplementedError):
    """A backend was asked for something it does not implement (the message names a backend that does)."""


class UnknownName(MstarError, KeyError):
    """A name (a request, a label, a wrapper kind) that is not known here."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ConfigError(MstarError, ValueError):
    """A configuration file, table or key that is not valid (the message names the closest known one)."""


class StateError(MstarError, RuntimeError):
    """A call that the object's current state does not allow (e.g. a plan for a step not admitted)."""


class BackendUnavailable(MstarError, ValueError):
    """The requested backend does not exist or cannot run this request here."""

    def __init__(self, message: str, *, requested: str, reasons: Mapping[str, Sequence[str]] | None = None,
                 available: Sequence[str] = (), known: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.requested = requested
        self.reasons = {k: list(v) for k, v in (reasons or {}).items()}
        self.available = list(available)
        self.known = list(known)


class PluginError(MstarError, RuntimeError):
    """A plugin failure in strict mode (the message names the plugin; the cause, if any, is
    chained), or a hand registration of a taken name."""


class CommitError(MstarError, RuntimeError):
    """A resource's ``commit`` raised. ``committed`` names the resources that had already
    committed the step (their part of it is recorded: do not run the same tokens again),
    ``failed`` the one that raised, ``rolled_back`` the ones whose admit was undone instead."""

    def __init__(self, failed: str, committed: Sequence[str], rolled_back: Sequence[str], cause: BaseException) -> None:
        self.failed, self.committed, self.rolled_back = failed, tuple(committed), tuple(rolled_back)
        super().__init__(
            f"commit failed in resource {failed!r} ({type(cause).__name__}: {cause}); already committed: "
            f"{list(committed) or 'none'} (their part of the step is recorded: do not re-run the step's tokens "
            f"there); rolled back: {list(rolled_back)}"
        )


class TensorParallelError(MstarError, RuntimeError):
    """A collective failed or timed out: another rank failed or stalled."""


class CompileError(MstarError, RuntimeError):
    """``torch.compile`` of a model's step failed where compiling was asked for explicitly."""


class UnsupportedModel(MstarError, ValueError):
    """The model asks for an attention feature mstar does not serve (the message names it)."""
