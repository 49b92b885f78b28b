"""The shared-prefix demo: requests that begin with one of a few "system prompts" served through
the paged KV manager's prefix cache, then again without it.

With the cache, each request starts its stream with ``admit_prefix``: the full pages its prompt
begins with that an earlier request committed are shared (read-only), and its first step computes
only the rest of the prompt. Requests arrive in waves, some together (they cannot share with each
other: nothing is published before a step commits), and the page pool is small, so the pages of a
system prompt nobody uses for a while go idle and are evicted, deepest first, for newer requests;
a request that repeats an earlier prompt whose pages are still cached finds all of it but the last
token, which it computes. A request joins only when the pool can hold all it will take besides
what the running requests will still take, so no step is refused.

Every generated token's logits are checked against a full forward of the tiny decoder over the
request's tokens with no cache at all (as the text demo does), in both runs, and both runs must
generate the same tokens."""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from mstar_core.attention.paged import PagedAttentionManager
from mstar_core.capabilities import PAGED, STEP_KINDS, paged_step_capability
from mstar_core.config import ConfigSource
from mstar_core.demo.text import LABEL, Request, _forward, reference_logits
from mstar_core.demo.tiny import TinyDecoder, TinyDecoderConfig
from mstar_core.errors import StateError
from mstar_core.kv import KVConfig, KVManager
from mstar_core.kv.paged import pages_for
from mstar_core.kv.prefix import PrefixCache, PrefixStats
from mstar_core.node import Node
from mstar_core.step import KVSpan, KVStep, Step

MODEL = "tiny-decoder"  # the weights' identity in the prefix cache's root (with the seed)


@dataclass(frozen=True)
class Arrival:
    """One request: ``prefix`` (a system prompt) and a tail of its own, or ``repeat``: the exact
    prompt of an earlier request."""

    prefix: int
    tail: int  # tokens after the system prompt
    new: int  # tokens to generate
    at: int  # step at which it arrives
    repeat: int | None = None  # index of the request whose prompt this one repeats


@dataclass(frozen=True)
class SharedPrefixShape:
    num_layers: int = 2
    page_size: int = 8
    # The pool: too small to keep every system prompt's pages once the later waves arrive.
    max_pages: int = 16
    prefixes: tuple[int, ...] = (24, 20, 32)  # system prompt lengths: 3, 2.5 and 4 pages
    arrivals: tuple[Arrival, ...] = (
        # together: r0 and r1 both compute system prompt 0 (nothing is published before a commit)
        Arrival(0, 9, 4, 0), Arrival(0, 5, 4, 0), Arrival(1, 6, 4, 0),
        Arrival(0, 3, 5, 2), Arrival(1, 11, 4, 2),
        Arrival(0, 0, 4, 4, repeat=0),  # r0's 33 tokens: 4 full pages cached, computes its last token
        Arrival(2, 7, 4, 5), Arrival(2, 2, 4, 5), Arrival(1, 4, 3, 6),
        Arrival(2, 12, 4, 8), Arrival(2, 5, 5, 9), Arrival(2, 1, 4, 9),
        # system prompt 2 fills the pool: the idle pages of 0 and 1 are evicted (deepest first),
        # so they are computed again, in part or whole
        Arrival(2, 9, 4, 11), Arrival(2, 3, 4, 11), Arrival(0, 6, 4, 13), Arrival(0, 10, 4, 15),
        Arrival(1, 2, 4, 15),
        Arrival(2, 0, 4, 16, repeat=9),  # r9's prompt again, its last pages evicted by then
    )


@dataclass
class PrefixRequest(Request):
    cached: int = 0  # leading prompt tokens found in the prefix cache
    computed: int = 0  # prompt tokens its first step computed

    @property
    def step_tokens(self) -> list[int]:
        return self.prompt[self.cached:] if not self.prefilled else self.generated[-1:]


@dataclass
class Served:
    """One run over the requests: finished requests (by id) and what the run counted."""

    requests: dict[str, PrefixRequest]
    steps: dict[str, int]
    waits: int  # requests that waited for pages
    seconds: float
    stats: PrefixStats | None = None  # None: the cache was off
    cached_pages: int = 0  # at the end
    idle_pages: int = 0

    @property
    def prefill(self) -> int:
        return sum(r.computed for r in self.requests.values())


@dataclass
class SharedPrefixReport:
    backend: str
    shape: SharedPrefixShape
    cached: Served
    plain: Served
    tolerance: float
    max_error: float  # the largest |logit error| of either run against the no-cache forward
    mismatches: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(r.generated) for r in self.cached.requests.values())

    @property
    def ok(self) -> bool:
        return not self.mismatches and self.max_error <= self.tolerance  # (NaN fails)

    def lines(self) -> list[str]:
        s, c, p = self.shape, self.cached, self.plain
        st = c.stats
        assert st is not None
        reqs = list(c.requests.values())
        prompt = sum(len(r.prompt) for r in reqs)
        missed = sum(1 for r in reqs if not r.cached)
        full = [r for r in reqs if r.cached == len(r.prompt) - 1]
        whole = ", ".join(f"{r.rid} found {r.cached} of {len(r.prompt)} and computed {r.computed}" for r in full)
        steps = (f"{sum(c.steps.values())} with the cache ({c.seconds:.2f} s), "
                 f"{sum(p.steps.values())} without ({p.seconds:.2f} s)")
        lines = [
            f"backend: {self.backend}",
            f"system prompts: {len(s.prefixes)} ({', '.join(map(str, s.prefixes))} tokens); pages of {s.page_size} "
            f"tokens, a pool of {s.max_pages}",
            f"requests: {len(reqs)}, {prompt} prompt tokens; found cached: {st.hit_tokens} "
            f"(hit rate {st.hit_rate:.0%}); {missed} found nothing",
            f"prompts found whole (all but the last token): {whole or 'none'}",
            f"prefill tokens computed: {c.prefill} with the cache, {p.prefill} without",
            f"pages published: {st.published}, evicted: {st.evicted}; at the end {c.cached_pages} cached "
            f"({c.idle_pages} idle)",
            f"steps: {steps}; requests that waited for pages: {c.waits} with the cache, {p.waits} without",
            f"largest |logit error| vs no-cache forward: {self.max_error:.3g} (tolerance {self.tolerance:g})",
        ]
        if self.ok:
            lines.append(f"all {self.tokens} tokens match the no-cache forward: OK")
        else:
            lines += [f"MISMATCH: {m}" for m in self.mismatches[:8]]
            if len(self.mismatches) > 8:
                lines.append(f"MISMATCH: {len(self.mismatches) - 8} more")
        return lines


def make_requests(shape: SharedPrefixShape, vocab: int, seed: int) -> list[PrefixRequest]:
    """The system prompts and every request's tail, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    systems = [draw(n) for n in shape.prefixes]
    out: list[PrefixRequest] = []
    for i, a in enumerate(shape.arrivals):
        prompt = list(out[a.repeat].prompt) if a.repeat is not None else systems[a.prefix] + draw(a.tail)
        out.append(PrefixRequest(f"r{i}", prompt, a.new, a.at))
    return out


def serve(model: TinyDecoder, requests: list[PrefixRequest], wrappers: Mapping[str, type], backend_name: str,
          shape: SharedPrefixShape, prefix_cache: bool, seed: int = 0) -> Served:
    """Serve ``requests`` (continuous batching, greedy) to completion through a fresh KV manager,
    with the prefix cache or without. The page accounting is checked after every step."""
    cfg, device, dtype = model.cfg, str(model.device), model.dtype
    kv_cfg = KVConfig(cfg.num_layers, model.num_kv_heads, cfg.head_dim, shape.page_size, shape.max_pages,
                      model.num_qo_heads)
    kv = KVManager(kv_cfg, device, dtype, prefix_cache=prefix_cache)
    attn = PagedAttentionManager(kv, device, dtype, kv_cfg, wrappers, backend_name=backend_name)
    node = Node([attn, kv])
    root = node.prefix_root(f"{MODEL}:{cfg}:seed={seed}")  # the weights: config and seed
    ps = shape.page_size

    def to_take(r: PrefixRequest) -> int:
        """Pages ``r``'s stream will still take: it ends holding ``prompt + new - 1`` tokens
        (the last generated token is never run)."""
        st = kv.streams.get((r.rid, LABEL))
        return pages_for(len(r.prompt) + r.max_new - 1, ps) - (len(st.pages) if st is not None else 0)

    pending = list(requests)
    active: list[PrefixRequest] = []
    done: dict[str, PrefixRequest] = {}
    kinds = {"prefill": 0, "mixed": 0, "decode": 0}
    waited: set[str] = set()
    step_no = 0
    t0 = time.perf_counter()
    while pending or active:
        # Admission, first come first served: a request joins when the pool can hold all it will
        # take as well as what the running requests will still take, so no step is ever refused.
        # Its cached pages count as taken (an idle page it revives is no longer free).
        reserved = sum(to_take(r) for r in active)
        for r in [r for r in pending if r.arrives <= step_no]:
            if kv.num_free_pages - reserved < pages_for(len(r.prompt) + r.max_new - 1, ps):
                waited.add(r.rid)
                break
            pending.remove(r)
            node.ingest_request(r.rid)
            if prefix_cache:
                expect = kv.match_prefix(r.prompt, root, LABEL)
                r.cached = kv.admit_prefix(r.rid, LABEL, r.prompt, root).cached_tokens
                if r.cached != expect:
                    raise StateError(f"{r.rid}: match_prefix said {expect} tokens, admit_prefix found {r.cached}")
            active.append(r)
            reserved += to_take(r)
        if active:
            batch = list(active)
            step = Step(KVStep(tuple(KVSpan(r.rid, LABEL, len(r.step_tokens)) for r in batch)))
            rows: list[Request] = [*batch]  # the text demo's forward: each row's logits and greedy token
            res = node.step(step, functools.partial(_forward, model, kv, attn, rows, device=device))
            if not res.outcome:
                raise StateError(f"step {step_no} refused although admission left room: {res.outcome.reason()}")
            kinds[STEP_KINDS[paged_step_capability(tuple(len(r.step_tokens) for r in batch))]] += 1
            for r in batch:
                if not r.prefilled:
                    r.computed = len(r.step_tokens)
                r.prefilled = True
            kv.post_warmup_validate()  # every page free, held or idle, and held as often as streams say
        for r in [r for r in active if r.done]:
            active.remove(r)
            node.remove_request(r.rid)
            done[r.rid] = r
        step_no += 1
        if step_no > 1000:
            raise StateError("demo did not finish in 1000 steps")
    seconds = time.perf_counter() - t0
    served = Served(done, kinds, len(waited), seconds)
    if prefix_cache:
        pool = kv.pool
        assert isinstance(pool, PrefixCache)
        served.stats = PrefixStats(**vars(pool.stats))
        served.cached_pages, served.idle_pages = pool.cached, pool.idle
    node.cleanup()
    return served


def check(model: TinyDecoder, cached: Served, plain: Served, tol: float) -> tuple[float, list[str]]:
    """Every generated token's logits in both runs against the no-cache forward (the largest
    error), and the mismatches: a request whose logits are off by more than ``tol``, or whose
    tokens differ between the runs. At the first differing token both runs had the same tokens
    before, so both tokens' logits are within ``tol`` of the forward's: a difference is a mismatch
    unless the forward finds the two tokens tied (within ``2 tol``)."""
    worst, bad = 0.0, []
    for rid, a in cached.requests.items():
        b = plain.requests[rid]
        ref = reference_logits(model, a)
        for run, r in (("with", a), ("without", b)):
            want = ref if r.generated == a.generated else reference_logits(model, r)
            err = float((torch.stack(r.logits) - want).abs().max())
            worst = max(worst, err)
            if not err <= tol:
                bad.append(f"{rid} {run} the cache: a logit {err:.3g} off the no-cache forward")
        i = next((i for i, (x, y) in enumerate(zip(a.generated, b.generated, strict=True)) if x != y), None)
        if i is not None:
            gap = float((ref[i, a.generated[i]] - ref[i, b.generated[i]]).abs())
            if gap > 2 * tol:
                bad.append(f"{rid}'s token {i}: {a.generated[i]} with the cache, {b.generated[i]} without "
                           f"(their no-cache logits differ by {gap:.3g})")
    return worst, bad


def run_shared_prefix(wrappers: Mapping[str, type], backend_name: str, device: str = "cpu",
                      dtype: torch.dtype = torch.float32, seed: int = 0,
                      shape: SharedPrefixShape = SharedPrefixShape()) -> SharedPrefixReport:
    """Serve :func:`make_requests` with the prefix cache and without, and compare."""
    cfg = TinyDecoderConfig(num_layers=shape.num_layers)
    model = TinyDecoder(cfg, device, dtype, seed=seed)
    tol = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    cached = serve(model, make_requests(shape, cfg.vocab_size, seed), wrappers, backend_name, shape, True, seed)
    plain = serve(model, make_requests(shape, cfg.vocab_size, seed), wrappers, backend_name, shape, False, seed)
    err, bad = check(model, cached, plain, tol)
    return SharedPrefixReport(backend_name, shape, cached, plain, tol, err, bad)


def main(backend: str | None = None, device: str = "cpu", seed: int = 0, config: ConfigSource = None) -> int:
    """``mstar demo --workload shared-prefix``: pick the paged backend (by name, config, env or
    auto), run, print the report; 0 when every token matched, else 1."""
    from mstar_core.registry import select_backend  # imports plugins: keep it out of module import

    dev = torch.device(device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    sel = select_backend(capabilities=PAGED, requested=backend, device=dev, dtype=dtype,
                         head_dim=TinyDecoderConfig().head_dim, config=config)
    report = run_shared_prefix(sel.classes, sel.name, device, dtype, seed)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1
