"""Stand-in for flashinfer.jit.attention.variants: the AttentionSink declarations per backend. The
real ones are CUDA source strings; these are placeholders the stand-in recognises by identity."""

attention_sink_fa2_decl = "/* stand-in: AttentionSink (fa2) */"
attention_sink_fa3_decl = "/* stand-in: AttentionSink (fa3) */"

attention_sink_decl = {
    "fa2": attention_sink_fa2_decl,
    "fa3": attention_sink_fa3_decl,
}
