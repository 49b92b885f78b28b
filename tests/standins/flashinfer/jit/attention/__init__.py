"""Stand-in for flashinfer.jit.attention: only ``variants`` (the sink variant's declarations)."""
