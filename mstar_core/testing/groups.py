"""The groups of ``mstar check``'s cases, by name (no torch here: the CLI lists them in its help)."""

# What each group checks; ``mstar check --group`` selects by these names.
GROUPS: dict[str, str] = {
    "plain": "page sizes, GQA, masks, windows, scales at the checked head dims",
    "shapes": "shapes past a kernel's usual tiles (64 rows, 64 query heads, odd page sizes)",
    "features": "the declared features, alone and combined",
    "edge": "a row poisoned with NaN/inf, rows that see no key",
    "numerics": "scores in the hundreds, rows whose every score is far below zero, long rows",
    "window": "a layer group's window on the feature cases",
    "replan": "one wrapper re-planned, and a refused plan",
    "layers": "several wrappers with different windows and scales, run in turn",
    "replay": "CUDA-graph replay after a new plan",
    "device": "the data on a GPU that is not the current one",
}
