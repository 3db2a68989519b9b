"""Which PP/TP engine shapes the tiny Llama takes (checked before any engine starts).

Kept apart from :mod:`pdplug_vllm.parity` so the CLI can refuse a bad ``--prefill-pp``,
``--prefill-tp`` or ``--decode-tp`` without importing vLLM, the proxy or the engines.
"""

from __future__ import annotations

from pdplug_engines.tiny_model import TinyLlama

__all__ = ["check_shape"]


def check_shape(*, prefill_pp: int = 1, prefill_tp: int = 1, decode_tp: int = 1) -> None:
    """Refuse an engine shape the tiny Llama cannot take.

    A PP stage needs at least one of its ``num_hidden_layers`` layers; a TP rank at least one
    of its ``num_key_value_heads`` KV heads, whole (vLLM splits heads evenly over TP ranks).

    :raises ValueError: the first bad value, named (``prefill_tp=3 is not one of [1, 2] ...``).
    """
    spec = TinyLlama()
    layers, heads = spec.num_hidden_layers, spec.num_key_value_heads
    tps = [t for t in range(1, heads + 1) if heads % t == 0]
    if not 1 <= prefill_pp <= layers:
        raise ValueError(f"prefill_pp={prefill_pp} is not in 1..{layers} (the tiny Llama has "
                         f"{layers} layers and every PP stage needs one)")  # fmt: skip
    for name, tp in (("prefill_tp", prefill_tp), ("decode_tp", decode_tp)):
        if tp not in tps:
            raise ValueError(f"{name}={tp} is not one of {tps} (the tiny Llama's {heads} KV heads "
                             "split evenly over the TP ranks)")  # fmt: skip
