"""The capability table: every capability name, the paged group, the step kind each names, and
which features reach which capability. Everything else reads these names from here.

A capability names one wrapper protocol a backend may provide: the paged manager's three
(prefill, decode, mixed steps over one paged cache), the dense path's prefixed ragged prefill
(``[frozen prefix | fresh tokens]`` per segment), and the bounded manager's attend.
"""

from __future__ import annotations

PAGED_PREFILL = "paged_prefill"
PAGED_DECODE = "paged_decode"
MIXED = "mixed"
PREFIXED_RAGGED = "prefixed_ragged"  # the dense path's wrapper
BOUNDED = "bounded"

# The paged manager's three, each from its own pick over one paged KV layout.
PAGED: tuple[str, ...] = (PAGED_PREFILL, PAGED_DECODE, MIXED)
CAPABILITIES: tuple[str, ...] = (*PAGED, PREFIXED_RAGGED, BOUNDED)

# The groups a build selects together (what `mstar warmup` warms): the paged manager and
# the dense path.
GROUPS: tuple[tuple[str, ...], ...] = (PAGED, (PREFIXED_RAGGED,))

# The kind of step (or conformance case) a capability's wrapper serves, as reports name it.
STEP_KINDS: dict[str, str] = {
    PAGED_PREFILL: "prefill",
    PAGED_DECODE: "decode",
    MIXED: "mixed",
    PREFIXED_RAGGED: "ragged",
}

# Which capabilities' wrappers a feature reaches (selection asks only these for it). The
# prefixed ragged wrappers take K/V in the model dtype: the dense manager dequantises an FP8
# prefix once per (stream, layer). Query tokens per decode row concern the decode path only.
FEATURE_REACH: dict[str, tuple[str, ...]] = {
    "fp8_e4m3": (*PAGED, BOUNDED),
    "fp8_e5m2": (*PAGED, BOUNDED),
    "soft_cap": (*PAGED, PREFIXED_RAGGED, BOUNDED),
    "sink_logits": (*PAGED, PREFIXED_RAGGED, BOUNDED),
    "layer_windows": (*PAGED, PREFIXED_RAGGED),
    "multi_token_decode": (PAGED_DECODE,),
}


def paged_step_capability(q_lens: tuple[int, ...]) -> str:
    """Which paged wrapper a label's rows need: decode when every row has one query token,
    mixed when one-token rows and longer rows share the step, prefill otherwise."""
    if q_lens and all(n == 1 for n in q_lens):
        return PAGED_DECODE
    if any(n == 1 for n in q_lens) and any(n > 1 for n in q_lens):
        return MIXED
    return PAGED_PREFILL
