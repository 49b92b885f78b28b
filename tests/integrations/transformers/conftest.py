"""These tests need the transformers extra (pip install '.[transformers]'); without it they are
not collected."""

import importlib.util

if importlib.util.find_spec("transformers") is None:
    collect_ignore_glob = ["test_*.py"]
