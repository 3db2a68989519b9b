"""Builds a tiny random-weight Llama checkpoint in Hugging Face format, on the fly.

No hub access is needed: ``config.json`` and ``model.safetensors`` are written from seeded
random weights, so every process that builds the same :class:`TinyLlama` gets bit-identical
weights. Any engine that loads a Hugging Face ``LlamaForCausalLM`` loads it (vLLM and SGLang
with their tokenizer skipped, token-id prompts).

The defaults fit vLLM's CPU attention: head size 32 (its smallest supported), KV block size a
multiple of 32 tokens, float32 so greedy decoding is reproducible across engines; other
engines pick their own geometry and dtype (e.g. 4 layers, bfloat16).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

__all__ = ["TinyLlama", "build_tiny_llama", "token_prompts"]


class TinyLlama(msgspec.Struct, frozen=True, kw_only=True):
    """Geometry of the tiny Llama (Hugging Face ``LlamaConfig`` fields).

    :ivar vocab_size: tokens in the vocabulary.
    :ivar hidden_size: model width (``num_attention_heads * head_dim``).
    :ivar intermediate_size: MLP width.
    :ivar num_hidden_layers: decoder layers (PP prefill slices these).
    :ivar num_attention_heads/num_key_value_heads: query and KV heads (GQA).
    :ivar head_dim: channels per head (vLLM's CPU attention needs >= 32).
    :ivar max_position_embeddings: longest sequence in tokens.
    :ivar dtype: ``torch_dtype`` of the checkpoint.
    :ivar seed: seed of the random weights.
    :ivar logit_scale: std of the embedding / LM head weights; a large value keeps the greedy
        argmax far from ties, so engines that differ only in batching agree token for token.
    """

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    seed: int = 0
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.num_attention_heads * self.head_dim != self.hidden_size:
            raise ValueError(
                f"TinyLlama: num_attention_heads*head_dim = {self.num_attention_heads}*"
                f"{self.head_dim} != hidden_size={self.hidden_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TinyLlama: num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}"
            )

    def hf_config(self) -> dict[str, object]:
        """The ``config.json`` document."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }


def _weights(spec: TinyLlama) -> dict[str, object]:
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, i, kv = spec.hidden_size, spec.intermediate_size, spec.num_key_value_heads * spec.head_dim

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    out: dict[str, object] = {
        "model.embed_tokens.weight": rand(spec.vocab_size, h, std=spec.logit_scale),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": rand(spec.vocab_size, h, std=spec.logit_scale),
    }
    std = h**-0.5
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        out[p + "self_attn.q_proj.weight"] = rand(h, h, std=std)
        out[p + "self_attn.k_proj.weight"] = rand(kv, h, std=std)
        out[p + "self_attn.v_proj.weight"] = rand(kv, h, std=std)
        out[p + "self_attn.o_proj.weight"] = rand(h, h, std=std)
        out[p + "mlp.gate_proj.weight"] = rand(i, h, std=std)
        out[p + "mlp.up_proj.weight"] = rand(i, h, std=std)
        out[p + "mlp.down_proj.weight"] = rand(h, i, std=i**-0.5)
    return out


def build_tiny_llama(directory: str | Path, spec: TinyLlama | None = None) -> Path:
    """Write the checkpoint of ``spec`` into ``directory`` (created) unless it is already there.

    A directory that holds the same ``config.json`` (and a ``model.safetensors``) is reused,
    so concurrent engines pointed at one directory load the same files.

    :param directory: where to write ``config.json``, ``generation_config.json`` and
        ``model.safetensors``.
    :param spec: the geometry (default :class:`TinyLlama`).
    :returns: the directory, to pass as vLLM's ``model``.
    :raises ValueError: the directory holds a different model's ``config.json``.
    """
    from safetensors.torch import save_file

    spec = spec or TinyLlama()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = spec.hf_config()
    cfg_file = path / "config.json"
    weights = path / "model.safetensors"
    if cfg_file.exists():
        found = json.loads(cfg_file.read_text())
        if found != config:
            raise ValueError(f"build_tiny_llama: {cfg_file} holds another model: {found}")
        if weights.exists():
            return path
    tmp = path / f".model.{spec.seed}.tmp"
    save_file(_weights(spec), str(tmp))  # type: ignore[arg-type]
    tmp.replace(weights)
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
    )
    cfg_file.write_text(json.dumps(config, indent=1, sort_keys=True))
    return path


def token_prompts(
    count: int, length: int, vocab_size: int, *, seed: int = 0, shared_prefix: int = 0
) -> list[list[int]]:
    """Deterministic token-id prompts.

    :param count: number of prompts.
    :param length: tokens per prompt.
    :param vocab_size: ids are drawn from ``[3, vocab_size)`` (0-2 are pad/bos/eos).
    :param seed: RNG seed.
    :param shared_prefix: leading tokens common to every prompt (prefix-cache hits).
    :returns: ``count`` lists of ``length`` ints.
    :raises ValueError: ``shared_prefix > length`` or a non-positive size.
    """
    import numpy as np

    if count <= 0 or length <= 0 or vocab_size <= 3:
        raise ValueError(
            f"token_prompts: count={count}, length={length}, vocab_size={vocab_size} must be "
            "positive (vocab_size > 3)"
        )
    if not 0 <= shared_prefix <= length:
        raise ValueError(f"token_prompts: shared_prefix={shared_prefix} not in [0, {length}]")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab_size, shared_prefix).tolist()
    return [
        prefix + rng.integers(3, vocab_size, length - shared_prefix).tolist() for _ in range(count)
    ]
