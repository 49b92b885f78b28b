"""Multi-token decode rows captured on the FlashInfer wrappers (stand-in on CPU)."""

import torch

from ...helpers import multi_token_graph_node, verify_multi_token_decode


def test_multi_token_decode_on_flashinfer_graph_wrappers(standin_flashinfer):
    """The FlashInfer prefill wrapper in graph mode (static rows and tokens) runs the rows; its
    decode wrapper is not used for them."""
    from mstar_flashinfer.decode import FlashInferDecodeWrapper
    from mstar_flashinfer.mixed import FlashInferMixedWrapper
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper

    wrappers = {"paged_prefill": FlashInferPrefillWrapper, "paged_decode": FlashInferDecodeWrapper,
                "mixed": FlashInferMixedWrapper}
    model, _, attn, node, runner = multi_token_graph_node(4, wrappers=wrappers, dtype=torch.float32)
    runner.warmup()
    verify_multi_token_decode(model, node, runner, 4, atol=2e-4)
    graph_kinds = {k[1] for k in attn._wrappers if k[3] is not None}
    assert graph_kinds == {"paged_prefill"}
