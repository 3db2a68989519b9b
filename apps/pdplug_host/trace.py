"""Trace loader: Mooncake FAST'25 records or ShareGPT conversations → scaled ``TraceRequest``s.

A Mooncake record is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}`` with one hash id per 512-token block, one per line or in a JSON array;
ShareGPT conversations are converted to such records (see :func:`parse_trace_text`). ``scale``
shrinks everything by the same factor (default 32: a 512-token block becomes 16 tokens, one
default page). A block's token ids are drawn from a numpy Generator seeded with
``(seed, hash_id)``, so equal hash ids give equal tokens and the trace's prefix reuse becomes
real prefix-cache hits.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

__all__ = [
    "CHARS_PER_TOKEN",
    "EXPECTED",
    "TRACE_BLOCK_TOKENS",
    "TraceFormatError",
    "TraceRequest",
    "block_hash_chain",
    "load_trace",
    "parse_trace_lines",
    "parse_trace_text",
    "prompt_tokens",
    "trace_prompts",
]

TRACE_BLOCK_TOKENS = 512  # tokens per hash block in the unscaled trace
#: characters per token when a ShareGPT conversation's lengths are estimated (no tokenizer)
CHARS_PER_TOKEN = 4
#: the accepted formats, named in every format error
EXPECTED = (
    'expected Mooncake trace records {"timestamp": ms, "input_length": tokens, '
    '"output_length": tokens, "hash_ids": [ids]} one per line or in a JSON array, or ShareGPT '
    'conversations [{"conversations": [{"from": "human", "value": ...}, '
    '{"from": "gpt", "value": ...}]}]'
)

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


def _request(rec: _Record, rid: int, scale: int, max_output: int, block: int) -> TraceRequest:
    return TraceRequest(
        rid=rid,
        arrival_ms=float(rec.timestamp),
        input_len=max(1, -(-rec.input_length // scale)),
        output_len=max(1, min(rec.output_length, max_output)),
        hash_ids=tuple(rec.hash_ids),
        block_tokens=block,
        raw_input_length=rec.input_length,
        raw_output_length=rec.output_length,
    )


def _text_hash_ids(text: str) -> list[int]:
    # One id per 512-token block of the prompt (CHARS_PER_TOKEN chars per token), chained so
    # equal ids at a position mean an equal prefix: shared system prompts become cache hits.
    step = TRACE_BLOCK_TOKENS * CHARS_PER_TOKEN
    ids, prev = [], b""
    for start in range(0, len(text), step):
        prev = hashlib.blake2b(prev + text[start : start + step].encode(), digest_size=8).digest()
        ids.append(int.from_bytes(prev, "little") & ((1 << 63) - 1))
    return ids


def _sharegpt_record(obj: dict[str, object], where: str) -> _Record | None:
    turns = obj.get("conversations")
    if not isinstance(turns, list) or not all(
        isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns
    ):
        raise TraceFormatError(
            f'{where}: field \'conversations\' must be a list of {{"from": ..., "value": '
            f"text}} turns; {EXPECTED}"
        )
    if len(turns) < 2 or not turns[0]["value"]:
        return None  # no prompt/answer pair: skipped, as serving benchmarks do
    prompt, answer = str(turns[0]["value"]), str(turns[1]["value"])
    n_in = max(1, -(-len(prompt) // CHARS_PER_TOKEN))
    n_out = max(1, -(-len(answer) // CHARS_PER_TOKEN))
    return _Record(0.0, n_in, n_out, _text_hash_ids(prompt) or [0])


def _record(obj: object, where: str) -> _Record | None:
    if not isinstance(obj, dict):
        raise TraceFormatError(
            f"{where}: Expected `object` (one trace record), got {type(obj).__name__}; {EXPECTED}"
        )
    if "conversations" in obj:
        return _sharegpt_record(obj, where)
    try:
        rec = msgspec.convert(obj, _Record)
    except msgspec.ValidationError as e:
        raise TraceFormatError(f"{where}: {_describe(obj, e)}") from None
    want = -(-rec.input_length // TRACE_BLOCK_TOKENS)
    if len(rec.hash_ids) != want:
        raise TraceFormatError(
            f"{where}: field 'hash_ids' has {len(rec.hash_ids)} ids, expected "
            f"ceil(input_length={rec.input_length} / {TRACE_BLOCK_TOKENS}) = {want}"
        )
    return rec


def _requests(
    objs: Iterable[tuple[str, object]], scale: int, max_output: int, limit: int | None
) -> list[TraceRequest]:
    block = _check_scale(scale, max_output)
    out: list[TraceRequest] = []
    for where, obj in objs:
        if limit is not None and len(out) >= limit:
            break
        rec = _record(obj, where)
        if rec is not None:
            out.append(_request(rec, len(out), scale, max_output, block))
    return out


def _jsonl(lines: Iterable[str | bytes], source: str) -> Iterator[tuple[str, object]]:
    decoder = msgspec.json.Decoder()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = decoder.decode(line)
        except msgspec.DecodeError as e:
            raise TraceFormatError(f"{source}:{lineno}: invalid JSON: {e}; {EXPECTED}") from None
        yield f"{source}:{lineno}", obj


def parse_trace_lines(
    lines: Iterable[str | bytes],
    *,
    source: str = "<trace>",
    scale: int = 32,
    max_output: int = 16,
    limit: int | None = None,
) -> list[TraceRequest]:
    """Parse JSON-lines trace records (blank lines skipped) into scaled requests.

    A line is a Mooncake record or a ShareGPT conversation (see :func:`parse_trace_text`).

    :raises TraceFormatError: invalid JSON, a record that is not an object, a
        missing/mistyped/negative field, or ``hash_ids`` whose length is not
        ``ceil(input_length / 512)``; the message is ``"{source}:{line}: ..."`` and names the
        field and its value.
    :raises ValueError: ``scale`` not a positive divisor of 512, or ``max_output < 1``.
    """
    return _requests(_jsonl(lines, source), scale, max_output, limit)


def parse_trace_text(
    text: str,
    *,
    source: str = "<trace>",
    scale: int = 32,
    max_output: int = 16,
    limit: int | None = None,
) -> list[TraceRequest]:
    """Parse a whole trace: JSON lines, or one JSON array, of records of either kind.

    * Mooncake (FAST'25) records: ``{"timestamp": ms, "input_length": tokens,
      "output_length": tokens, "hash_ids": [one id per 512-token block]}``.
    * ShareGPT conversations: ``{"conversations": [{"from": "human", "value": prompt},
      {"from": "gpt", "value": answer}, ...]}``; the first turn is the prompt and the second the
      output. Without a tokenizer, tokens are ``ceil(characters / 4)``
      (:data:`CHARS_PER_TOKEN`); every conversation arrives at time 0; hash ids chain the
      prompt's 2,048-character blocks, so equal prompt prefixes share ids (prefix-cache hits).
      Conversations with fewer than two turns or an empty prompt are skipped.

    :raises TraceFormatError: as :func:`parse_trace_lines`, records named ``{source}:{line}``
        (JSON lines) or ``{source}: record {n}`` (array); the message ends with the expected
        format.
    """
    if text.lstrip().startswith("["):
        try:
            arr = msgspec.json.decode(text)
        except msgspec.DecodeError as e:
            raise TraceFormatError(f"{source}: invalid JSON array: {e}; {EXPECTED}") from None
        if not isinstance(arr, list):  # pragma: no cover - a "[" always decodes to a list
            raise TraceFormatError(f"{source}: not a JSON array; {EXPECTED}")
        objs: Iterable[tuple[str, object]] = (
            (f"{source}: record {i}", o) for i, o in enumerate(arr, start=1)
        )
        return _requests(objs, scale, max_output, limit)
    return parse_trace_lines(
        text.splitlines(), source=source, scale=scale, max_output=max_output, limit=limit
    )


def load_trace(
    path: str | Path | None = None,
    limit: int | None = None,
    scale: int = 32,
    max_output: int = 16,
) -> list[TraceRequest]:
    """Load a trace file (``None``: the bundled 64-request sample) and scale it.

    :param limit: keep the first ``limit`` requests.
    :raises OSError: the file cannot be read.
    :raises TraceFormatError: the file is not UTF-8 text, or as :func:`parse_trace_text`; the
        message names the file and the expected format.
    """
    if path is None:
        res = importlib.resources.files("pdplug_host") / "data" / "conversation_sample.jsonl"
        data, source = res.read_bytes(), "conversation_sample.jsonl"
    else:
        data, source = Path(path).read_bytes(), str(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(
            f"{source}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); {EXPECTED}"
        ) from None
    return parse_trace_text(text, source=source, scale=scale, max_output=max_output, limit=limit)


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

    :raises ValueError: ``vocab < 1`` or ``req`` has fewer hash ids than prompt blocks.
    """
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


def trace_prompts(limit: int = 16, scale: int = 32, vocab: int = 1024) -> list[list[int]]:
    """Token-id prompts of the first ``limit`` requests of the bundled trace (the reference
    demo's, scaled by ``scale``; shared prefixes stay shared), ids below ``vocab``."""
    return [prompt_tokens(r, vocab).tolist() for r in load_trace(limit=limit, scale=scale)]
