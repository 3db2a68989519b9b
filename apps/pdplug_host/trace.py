"""Mooncake FAST'25 trace loader: JSONL records → scaled ``TraceRequest``s with seeded tokens.

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}`` with one hash id per 512-token block. ``scale`` shrinks everything by the
same factor (default 32: a 512-token block becomes 16 tokens, one default page). A block's token
ids are drawn from a numpy Generator seeded with ``(seed, hash_id)``, so equal hash ids give equal
tokens and the trace's prefix reuse becomes real prefix-cache hits.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "TraceFormatError",
    "TraceRequest",
    "block_hash_chain",
    "load_trace",
    "parse_trace_lines",
    "prompt_tokens",
]

TRACE_BLOCK_TOKENS = 512  # tokens per hash block in the unscaled trace

_NonNeg = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Pos = Annotated[int, msgspec.Meta(ge=1)]


class _Record(msgspec.Struct, frozen=True):
    # One JSONL line as written in the trace; unknown extra fields are ignored.
    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: _Pos
    output_length: _Pos
    hash_ids: list[_NonNeg]


class TraceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request after scaling.

    Attributes:
        rid: 0-based line index among the loaded records.
        arrival_ms: arrival time in milliseconds from trace start (unscaled).
        input_len: prompt tokens after scaling (``ceil(input_length / scale)``, >= 1).
        output_len: tokens to generate (``min(output_length, max_output)``, >= 1).
        hash_ids: one id per block of the prompt (the last block may be partial).
        block_tokens: tokens per block after scaling (``512 // scale``).
        raw_input_length, raw_output_length: the unscaled trace values (tokens).
    """

    rid: int
    arrival_ms: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    block_tokens: int
    raw_input_length: int
    raw_output_length: int

    @property
    def num_full_blocks(self) -> int:
        """Blocks entirely inside the prompt (the prefix-cacheable ones)."""
        return self.input_len // self.block_tokens


class TraceFormatError(ValueError):
    """A trace line failed to parse or validate; the message names file, line, field and value."""


_PATH_RE = re.compile(r"at `\$\.(\w+)(?:\[(\d+)\])?`")
_MISSING_RE = re.compile(r"missing required field `(\w+)`")


def _describe(obj: object, err: msgspec.ValidationError) -> str:
    # msgspec names the path but not the offending value; look it up in the untyped object.
    msg = str(err)
    if m := _MISSING_RE.search(msg):
        return f"field '{m.group(1)}' is missing"
    if m := _PATH_RE.search(msg):
        field, index = m.group(1), m.group(2)
        value = obj.get(field) if isinstance(obj, dict) else None
        where = field
        if index is not None and isinstance(value, list) and int(index) < len(value):
            value, where = value[int(index)], f"{field}[{index}]"
        return f"field '{where}' = {value!r}: {msg.split(' - at ')[0]}"
    return msg


def _check_scale(scale: int, max_output: int) -> int:
    if not isinstance(scale, int) or scale < 1 or TRACE_BLOCK_TOKENS % scale:
        raise ValueError(f"scale must be a positive divisor of {TRACE_BLOCK_TOKENS}, got {scale!r}")
    if max_output < 1:
        raise ValueError(f"max_output must be >= 1, got {max_output}")
    return TRACE_BLOCK_TOKENS // scale


def parse_trace_lines(
    lines: Iterable[str | bytes],
    *,
    source: str = "<trace>",
    scale: int = 32,
    max_output: int = 16,
    limit: int | None = None,
) -> list[TraceRequest]:
    """Parse JSONL trace lines (blank lines skipped) into scaled requests.

    Raises:
        TraceFormatError: invalid JSON, a missing/mistyped/negative field, or ``hash_ids`` whose
            length is not ``ceil(input_length / 512)``; the message is
            ``"{source}:{line}: field '{name}' = {value!r}: …"``.
        ValueError: ``scale`` not a positive divisor of 512, or ``max_output < 1``.
    """
    block_tokens = _check_scale(scale, max_output)
    decoder = msgspec.json.Decoder()
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, start=1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        try:
            obj = decoder.decode(line)
        except msgspec.DecodeError as e:
            raise TraceFormatError(f"{source}:{lineno}: invalid JSON: {e}") from None
        try:
            rec = msgspec.convert(obj, _Record)
        except msgspec.ValidationError as e:
            raise TraceFormatError(f"{source}:{lineno}: {_describe(obj, e)}") from None
        want = -(-rec.input_length // TRACE_BLOCK_TOKENS)
        if len(rec.hash_ids) != want:
            raise TraceFormatError(
                f"{source}:{lineno}: field 'hash_ids' has {len(rec.hash_ids)} ids, expected "
                f"ceil(input_length={rec.input_length} / {TRACE_BLOCK_TOKENS}) = {want}"
            )
        out.append(
            TraceRequest(
                rid=len(out),
                arrival_ms=float(rec.timestamp),
                input_len=max(1, -(-rec.input_length // scale)),
                output_len=max(1, min(rec.output_length, max_output)),
                hash_ids=tuple(rec.hash_ids),
                block_tokens=block_tokens,
                raw_input_length=rec.input_length,
                raw_output_length=rec.output_length,
            )
        )
    return out


def load_trace(
    path: str | Path | None = None,
    limit: int | None = None,
    scale: int = 32,
    max_output: int = 16,
) -> list[TraceRequest]:
    """Load a trace file (``None``: the bundled 64-request sample) and scale it.

    ``limit`` keeps the first N requests. Raises OSError if the file cannot be read, plus the
    errors of ``parse_trace_lines``."""
    if path is None:
        res = importlib.resources.files("pdplug_host") / "data" / "conversation_sample.jsonl"
        text, source = res.read_text(encoding="utf-8"), "conversation_sample.jsonl"
    else:
        text, source = Path(path).read_text(encoding="utf-8"), str(path)
    return parse_trace_lines(
        text.splitlines(), source=source, scale=scale, max_output=max_output, limit=limit
    )


@lru_cache(maxsize=1 << 16)
def _block_tokens(hash_id: int, block_tokens: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, hash_id])
    arr = rng.integers(0, vocab, size=block_tokens, dtype=np.int64)
    arr.flags.writeable = False  # shared through the cache
    return arr


def prompt_tokens(req: TraceRequest, vocab: int = 4096, seed: int = 0) -> np.ndarray:
    """Prompt token ids of ``req``: int64 [input_len], each in ``[0, vocab)``.

    Block k holds the ``block_tokens`` ids drawn from ``default_rng([seed, hash_ids[k]])``; the
    partial last block takes the first tokens of its block. Equal hash ids → equal tokens.

    Raises ValueError when ``vocab < 1`` or ``req`` has fewer hash ids than prompt blocks."""
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    bt = req.block_tokens
    nblocks = -(-req.input_len // bt)
    if len(req.hash_ids) < nblocks:
        raise ValueError(
            f"request {req.rid}: {len(req.hash_ids)} hash ids for {nblocks} blocks of {bt} tokens"
        )
    parts = [_block_tokens(h, bt, vocab, seed) for h in req.hash_ids[:nblocks]]
    return np.concatenate(parts)[: req.input_len].copy()


def block_hash_chain(req: TraceRequest) -> list[int]:
    """Chained hash per *full* prompt block: ``c_k = H(c_{k-1}, hash_ids[k])`` with ``c_{-1} = 0``.

    H is blake2b (8 bytes), masked to 63 bits so keys fit int64. Equal chains ⇔ equal token
    prefixes, so ``c_k`` keys the KV of tokens ``[0, (k+1) * block_tokens)``. Length
    ``input_len // block_tokens``."""
    chain, prev = [], 0
    for hid in req.hash_ids[: req.num_full_blocks]:
        digest = hashlib.blake2b(
            prev.to_bytes(8, "little") + hid.to_bytes(8, "little", signed=False), digest_size=8
        ).digest()
        prev = int.from_bytes(digest, "little") & ((1 << 63) - 1)
        chain.append(prev)
    return chain
