"""The rules ``mstar check`` enforces, by name. Every failing check raises :class:`RuleError`
naming one of them, the case, and the largest error it saw, so a report says what is wrong
(docs/PLUGINS.md, section 8, lists them)."""

from __future__ import annotations

import torch

RULES: dict[str, str] = {
    "oracle": "the output matches the float64 oracle within the dtype's tolerance",
    "shape": "the output is shaped like q: [tokens, num_qo_heads, head_dim]",
    "dtype": "the output is in q's dtype (the plan's dtype is q's dtype)",
    "device": "the output is on q's device",
    "no-key": "a query that sees no key returns zeros (or the plan is refused with a ValueError)",
    "isolation": "NaN or inf in one row's queries, keys or values never reaches another row's output",
    "stale-slots": "what a row does not own -- the unused slots of its last page, other pages -- may hold "
                   "anything, NaN included, and never reaches its output",
    "strided-inputs": "q (and dense k/v) may be strided views whose last dim is contiguous, such as slices of a "
                      "fused QKV projection",
    "inputs-unchanged": "run never writes into its inputs (q, k/v or the cache, the index arrays, sinks)",
    "owned-output": "the output belongs to the caller: no later run, of this wrapper or another, writes into it",
    "deterministic": "the same plan and inputs, run twice, give bit-identical outputs",
    "replan": "every plan replaces the previous one whole, and run uses the latest",
    "refused-plan": "a plan refused with an error leaves the previous plan usable, or refuses every run until the "
                    "next plan",
    "unknown-keyword": "a plan of another capability, or (contract 1.x) a keyword the wrapper does not implement, "
                       "raises; it never computes without it",
    "independent-wrappers": "wrappers of one backend keep their own plans: several planned with different windows "
                            "and scales (one per layer) and run in turn each compute their own",
    "replay": "a CUDA-graph replay after a new plan computes that plan",
    "runs": "a plan and run the contract allows complete without raising",
}


class RuleError(AssertionError):
    """A check failed: ``rule`` (a key of :data:`RULES`), where (backend, kind, case), what was
    seen, and ``error``, the largest error (relative to the oracle, or the largest difference
    between two outputs that must be equal)."""

    def __init__(self, rule: str, where: str, detail: str, error: float | None = None) -> None:
        assert rule in RULES, rule
        self.rule, self.where, self.detail, self.error = rule, where, detail, error
        super().__init__(f"{where}: {detail} -- rule {rule}: {RULES[rule]}")


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN equal to the same NaN, -0.0 not equal to 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(_bits(a).cpu(), _bits(b).cpu()))


def largest(diff: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """The largest entry of ``diff`` (NaN counts as inf) and its index."""
    d = diff.detach().to("cpu", torch.float64)
    d = torch.where(d.isnan(), float("inf"), d)
    if d.numel() == 0:
        return 0.0, ()
    flat = int(d.reshape(-1).argmax())
    value = float(d.reshape(-1)[flat])
    idx = []
    for size in reversed(d.shape):
        idx.append(flat % size)
        flat //= size
    return value, tuple(reversed(idx))


def at(index: tuple[int, ...], names: tuple[str, ...] = ("token", "head", "dim")) -> str:
    """``"token 3, head 5, dim 0"``."""
    if not index:
        return "nowhere"
    names = names if len(names) == len(index) else tuple(f"index {i}" for i in range(len(index)))
    return ", ".join(f"{n} {i}" for n, i in zip(names, index, strict=True))


def difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """The largest absolute difference of two same-shaped tensors (inf where one holds a NaN or
    an infinity the other does not hold there) and its index."""
    a64, b64 = (t.detach().to("cpu", torch.float64) for t in (a, b))
    diff = (a64 - b64).abs()
    diff = torch.where(diff.isnan(), float("inf"), diff)
    same = (a64 == b64) | (a64.isnan() & b64.isnan())  # equal infinities, NaN where both hold one
    return largest(diff.masked_fill(same, 0.0))


def snapshot(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of each input, taken before a run: :func:`check_unchanged` compares after it."""
    return {n: t.detach().clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}


def check_unchanged(where: str, inputs: dict[str, torch.Tensor], before: dict[str, torch.Tensor], when: str) -> None:
    """Every input holds the bits it held before (rule ``inputs-unchanged``)."""
    for name, was in before.items():
        now = inputs[name]
        if not bits_equal(now, was):
            if now.shape != was.shape:
                raise RuleError("inputs-unchanged", where, f"{when}, {name} changed shape from {tuple(was.shape)} "
                                f"to {tuple(now.shape)}", float("inf"))
            err, idx = difference(now, was)
            raise RuleError("inputs-unchanged", where, f"{when}, {name} changed: largest change {err:.3g} at "
                            f"{at(idx, tuple(f'index {i}' for i in range(len(idx))))}", err)
