"""``tests/datasets`` (the tests of ``comera.data``) lies on ``sys.path`` in a test run, where Python takes it
for a namespace package named ``datasets``; without the real ``datasets`` library installed,
``transformers`` then believes that library present and ``transformers.Trainer`` fails on
``datasets.Dataset``. So, when this folder's tests are collected (before they import ``transformers.Trainer``,
whose import asks), ``datasets`` is marked missing (``sys.modules["datasets"] = None``) unless it is really
installed, and ``transformers``' cached answer, if any, is dropped."""

import importlib.metadata
import sys

try:
    importlib.metadata.version("datasets")
except importlib.metadata.PackageNotFoundError:
    sys.modules["datasets"] = None
    import_utils = sys.modules.get("transformers.utils.import_utils")
    cached = getattr(import_utils, "is_datasets_available", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()
