"""Test support shipped with the core so that plugin distributions run the same suite."""
