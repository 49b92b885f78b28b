"""Backends shipped with the core (the plain-PyTorch reference)."""
