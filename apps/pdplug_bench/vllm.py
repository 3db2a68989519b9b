"""``pdplug bench vllm``: the command lives with the vLLM harness (:mod:`pdplug_vllm.bench`)."""

from __future__ import annotations

from pdplug_vllm.bench import cli

__all__ = ["cli"]
