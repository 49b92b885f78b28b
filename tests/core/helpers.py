import torch

from mstar_core import AdmitOutcome, Resource
from mstar_core.step import Shortage

from mstar_core.backends import reference as R
from mstar_core.kv import KVConfig, KVManager

REF_WRAPPERS = {
    "paged_prefill": R.ReferencePrefillWrapper,
    "paged_decode": R.ReferenceDecodeWrapper,
    "mixed": R.ReferenceMixedWrapper,
}


def small_kv(max_pages=8, page_size=4, layers=2, hkv=2, hq=4, d=8, dtype=torch.float64):
    cfg = KVConfig(layers, hkv, d, page_size, max_pages, hq)
    return KVManager(cfg, "cpu", dtype)


def tiny_graph_node(graphs=True, slots=2, buckets=(2, 4), max_pages=64, layers=2, hidden=64, head_dim=16, seed=3):
    """The tiny decoder over a paged KV manager and paged attention (reference wrappers), in one
    Node under a GraphRunner (not warmed up). Returns (model, kv, attn, node, runner)."""
    from mstar_core.graphs import GraphRunner
    from mstar_core.demo import TinyDecoder, TinyDecoderConfig
    from mstar_core.attention.paged import PagedAttentionManager
    from mstar_core.node import Node

    cfg = TinyDecoderConfig(num_layers=layers, hidden=hidden, mlp=2 * hidden, num_qo_heads=4, num_kv_heads=2,
                            head_dim=head_dim)
    model = TinyDecoder(cfg, "cpu", torch.float64, seed=seed)
    kvc = KVConfig(layers, 2, head_dim, 4, max_pages, 4)
    kv = KVManager(kvc, "cpu", torch.float64)
    attn = PagedAttentionManager(kv, "cpu", torch.float64, kvc, REF_WRAPPERS, accelerator_graph=graphs)
    node = Node([kv, attn])

    def forward(ctx, tokens):
        pos = ctx.plan_results["kv"].layout("text").positions
        return model.forward_step(tokens, pos, kv, attn, "text")

    return model, kv, attn, node, GraphRunner(node, forward, buckets=list(buckets), device="cpu", slots=slots)


class Logged(Resource):
    """A resource that logs its lifecycle calls into a shared list; refuses its admit, or raises
    in its commit, on cue."""

    def __init__(self, name, log, deps=(), refuse=False, fail_commit=False):
        self.name, self.log, self.deps = name, log, tuple(deps)
        self.refuse, self.fail_commit = refuse, fail_commit

    def depends_on(self):
        return self.deps

    def admit(self, step, ctx):
        self.log.append(("admit", self.name))
        if self.refuse:
            return AdmitOutcome.refuse(Shortage(self.name, "tickets", 1, 0))
        return AdmitOutcome.ok()

    def rollback_admit(self, step, ctx):
        self.log.append(("rollback", self.name))

    def commit(self, step, ctx):
        self.log.append(("commit", self.name))
        if self.fail_commit:
            raise OSError("disk full")
