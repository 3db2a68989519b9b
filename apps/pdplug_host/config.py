"""The tiny model's shape and the page arithmetic, without torch (the demo checks its options
before anything imports torch)."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["DTYPE_BYTES", "ModelConfig", "OutOfPagesError", "layer_split", "pages_needed"]

#: storage/compute dtype names the model accepts -> bytes per element
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


class OutOfPagesError(RuntimeError):
    """The page allocator cannot satisfy a request (nothing was allocated)."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Shape and numerics of the tiny model (msgspec Struct, so it can cross the wire).

    ``dtype`` is the storage dtype: weights are drawn in it and the KV cache holds it.
    ``compute_dtype`` is the activation dtype (float64: every path then differs only by float64
    rounding, so greedy argmax agrees even when two logits are close).

    :raises ValueError: a non-positive size, heads not divisible by KV heads, odd ``head_dim``,
        or an unknown dtype name.
    """

    num_layers: int = 4
    hidden: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 512
    vocab: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    dtype: str = "float32"
    compute_dtype: str = "float64"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("intermediate", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(
                    f"ModelConfig.{name} {getattr(self, name)!r} is not one of "
                    f"{sorted(DTYPE_BYTES)}"
                )

    @property
    def torch_dtype(self) -> Any:
        """Storage dtype of weights as drawn and of the KV cache (a ``torch.dtype``)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def torch_compute_dtype(self) -> Any:
        """Activation dtype (a ``torch.dtype``)."""
        import torch

        return getattr(torch, self.compute_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token row of one KV entry (one layer's K or V)."""
        return self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


def layer_split(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges for ``pp_size`` PP ranks; earlier ranks take the
    remainder.

    :raises ValueError: unless ``1 <= pp_size <= num_layers``.
    """
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pp_size must be in [1, num_layers={num_layers}], got {pp_size}")
    base, extra = divmod(num_layers, pp_size)
    ranges, start = [], 0
    for rank in range(pp_size):
        end = start + base + (1 if rank < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // page_size)
