"""SGLang backend tests: skipped without an installed SGLang (the tox env ``sglang`` installs
sglang 0.5.23 with its own constraints), unless ``PDPLUG_REQUIRE`` lists ``sglang``."""

from __future__ import annotations

import importlib.util
import os

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("sglang") is None:
    if "sglang" in os.environ.get("PDPLUG_REQUIRE", "").split(","):
        raise RuntimeError("PDPLUG_REQUIRE lists sglang but SGLang is not installed")
    collect_ignore_glob = ["test_*.py"]
