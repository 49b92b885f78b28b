"""The managers built from a spec whose ``"backend"`` (or config's ``attention.backend``) is a
capability table: each paged kind's wrapper from the backend the table names for it, errors
naming that backend; the dense manager takes its own capability's entry (or the default)."""

from __future__ import annotations

import pytest
import torch

from mstar_core import BuildInfo, DenseAttentionManager, PagedAttentionManager
from mstar_core.backends import reference as R

from ..helpers import install_decode_backend, step


class BrokenDecode(R.ReferenceDecodeWrapper):
    """A third-party decode kernel whose plan fails."""

    def plan(self, *args, **kw):
        raise RuntimeError("decode plan exploded")


@pytest.fixture
def info(fake_module, monkeypatch):
    install_decode_backend(fake_module, monkeypatch, "brokendec", BrokenDecode)
    from mstar_core import KVConfig, KVManager

    kv = KVManager(KVConfig(2, 2, 8, 4, 32, 4), "cpu", torch.float32)
    return BuildInfo(torch.device("cpu"), torch.float32, num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=8,
                     built={"kv": kv})


@pytest.mark.parametrize("where", ["spec", "config"])
def test_the_paged_manager_takes_each_kind_from_the_backend_a_table_names(info, where):
    table = {"paged_decode": "brokendec", "default": "reference"}
    spec = {"backend": table} if where == "spec" else {"config": {"attention": {"backend": table}}}
    attn = PagedAttentionManager.build(spec, info)
    assert attn.backend_names == {"paged_prefill": "reference", "paged_decode": "brokendec", "mixed": "reference"}
    assert attn.backend_name == "reference+brokendec"
    assert attn.wrapper_classes["paged_decode"] is BrokenDecode
    assert attn.wrapper_classes["paged_prefill"] is R.ReferencePrefillWrapper


def test_an_error_in_a_kind_s_wrapper_names_that_kind_s_backend(info):
    from mstar_core import Node, StepContext

    attn = PagedAttentionManager.build({"backend": {"paged_decode": "brokendec"}}, info)
    kv = info.built["kv"]
    node = Node([kv, attn])
    node.ingest_request("a")
    ctx = StepContext()
    prefill = step(("a", "text", 3))
    assert node.admit(prefill, ctx)
    node.plan(prefill, ctx)  # prefill on the reference plans
    node.commit(prefill, ctx)
    ctx = StepContext()
    decode = step(("a", "text", 1))
    assert node.admit(decode, ctx)
    with pytest.raises(RuntimeError, match="decode plan exploded") as e:
        node.plan(decode, ctx)
    assert any("attention backend 'brokendec'" in n for n in e.value.__notes__)


def test_a_table_naming_a_capability_the_dense_manager_serves_picks_its_wrapper(info):
    m = DenseAttentionManager.build({"backend": {"prefixed_ragged": "reference", "paged_decode": "brokendec"}}, info)
    assert m.wrapper_class is R.ReferencePrefixedPrefillWrapper and m.backend_name == "reference"
    # a table naming only paged capabilities leaves the dense one to auto
    m = DenseAttentionManager.build({"config": {"attention": {"backend": {"paged_decode": "brokendec"}}}}, info)
    assert m.wrapper_class is R.ReferencePrefixedPrefillWrapper
    # a default that cannot serve it is refused, naming the capability
    with pytest.raises(ValueError, match=r"'brokendec' \(brokendec-mstar 0.1, from argument, for prefixed_ragged\) "
                                         r"cannot run here.*does not provide prefixed_ragged"):
        DenseAttentionManager.build({"backend": {"default": "brokendec"}}, info)
