"""Stand-in for flashinfer.jit: where built modules live (env), and a pretend build that writes
``<name>/<name>.so`` there the first time a plan needs a module (no compiler runs), so the first-use
notice and ``mstar warmup`` can be tested on a CPU."""
