"""Adapters that put mstar under other libraries' model code. Each lives in its own subpackage,
imports its library there, and installs with an extra (``pip install '.[transformers]'`` in a clone): the core
never imports them."""
