"""The contract-version tests build their fixtures with the registry tests' wheel builder."""

from ..registry.conftest import build_wheel  # noqa: F401  (a fixture: pytest finds it here by name)
