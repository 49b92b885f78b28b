"""Adapters that put mstar under other libraries' model code. Each lives in its own subpackage,
imports its library there, and installs with an extra (``mstar-core[transformers]``): the core
never imports them."""
