"""Tiny Llama-style model with a paged KV cache, PP layer ranges, chunked prefill and DCP decode.

Architecture: token embedding, ``num_layers`` pre-norm blocks (RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP), final RMSNorm, untied LM head. Weights are drawn from ``torch.Generator``
seeded with ``ModelConfig.seed``, so every process builds bit-identical weights.

Numerics: weights are drawn in ``ModelConfig.dtype`` (float32) and the KV cache stores that dtype
(so the transfer layer moves float32 rows), but activations run in ``compute_dtype`` (float64 by
default). Every path (one-shot, chunked, PP split, prefix hit, DCP + LSE merge) reads K/V back from
the float32 cache before attending, so paths differ only by float64 rounding (~1e-15 relative) and
greedy argmax agrees even when two logits are close; float32 compute would flip a near-tie every
few thousand tokens.

Token layout in the cache: position ``pos`` of a request lives at flat slot
``page_ids[pos // page_size] * page_size + pos % page_size``. Under DCP, token ``i`` lives on DCP
rank ``i % dcp_size`` at local offset ``i // dcp_size``, addressed the same way through that rank's
local page list.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdplug_host.config import ModelConfig, OutOfPagesError, layer_split, pages_needed

__all__ = [
    "DTYPES",
    "GatherFn",
    "LayerWeights",
    "ModelConfig",
    "OutOfPagesError",
    "PagedKVCache",
    "SeqSpan",
    "TinyLlama",
    "attention",
    "build_model",
    "dcp_local_len",
    "decode_step",
    "decode_step_dcp",
    "embed",
    "final_logits",
    "forward",
    "forward_dense",
    "greedy",
    "layer_split",
    "merge_attention",
    "pages_needed",
    "prefill_chunk",
    "run_layers",
    "slot_mapping",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# Query rows per attention block: bounds the score matrix to
# num_heads * _Q_BLOCK * context * 8 bytes (8 MiB per 1,000 context tokens).
_Q_BLOCK = 128


@dataclass(frozen=True)
class LayerWeights:
    """One block's weights, all ``compute_dtype``; projections are right-multiplied (``x @ w``).

    Shapes: ``attn_norm``/``mlp_norm`` [hidden]; ``wqkv`` [hidden, (num_heads + 2*num_kv_heads)
    * head_dim] (q, k, v fused); ``wo`` [num_heads*head_dim, hidden]; ``w_gate_up`` [hidden,
    2*intermediate] (gate, up fused); ``w_down`` [intermediate, hidden].
    """

    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True)
class TinyLlama:
    """The whole model: ``embed`` [vocab, hidden], ``layers``, ``final_norm`` [hidden],
    ``lm_head`` [hidden, vocab], ``inv_freq`` [head_dim/2] (RoPE), all ``compute_dtype``."""

    config: ModelConfig
    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    inv_freq: torch.Tensor


def build_model(config: ModelConfig | None = None) -> TinyLlama:
    """Build the model with weights drawn from ``torch.Generator().manual_seed(config.seed)``.

    Weights are drawn in ``config.dtype`` in a fixed order (embed, then per layer q, k, v, o, gate,
    up, down, then lm_head) with std 1 for the embedding and 1/sqrt(fan_in) for projections, then
    stored in ``compute_dtype``. Deterministic across processes for a given torch version.
    """
    cfg = config or ModelConfig()
    gen = torch.Generator().manual_seed(cfg.seed)
    cdt = cfg.torch_compute_dtype

    def draw(fan_in: int, fan_out: int, std: float | None = None) -> torch.Tensor:
        w = torch.randn(fan_in, fan_out, generator=gen, dtype=cfg.torch_dtype)
        return (w * (std if std is not None else 1.0 / math.sqrt(fan_in))).to(cdt)

    h, hd = cfg.hidden, cfg.head_dim
    embed_w = draw(cfg.vocab, h, std=1.0)
    layers = []
    for _ in range(cfg.num_layers):
        wq = draw(h, cfg.num_heads * hd)
        wk = draw(h, cfg.num_kv_heads * hd)
        wv = draw(h, cfg.num_kv_heads * hd)
        wo = draw(cfg.num_heads * hd, h)
        w_gate = draw(h, cfg.intermediate)
        w_up = draw(h, cfg.intermediate)
        w_down = draw(cfg.intermediate, h)
        layers.append(
            LayerWeights(
                attn_norm=torch.ones(h, dtype=cdt),
                wqkv=torch.cat([wq, wk, wv], dim=1).contiguous(),
                wo=wo,
                mlp_norm=torch.ones(h, dtype=cdt),
                w_gate_up=torch.cat([w_gate, w_up], dim=1).contiguous(),
                w_down=w_down,
            )
        )
    lm_head = draw(h, cfg.vocab)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    return TinyLlama(
        config=cfg,
        embed=embed_w,
        layers=tuple(layers),
        final_norm=torch.ones(h, dtype=cdt),
        lm_head=lm_head,
        inv_freq=inv_freq.to(cdt),
    )


def dcp_local_len(num_tokens: int, dcp_rank: int, dcp_size: int) -> int:
    """How many of tokens ``[0, num_tokens)`` live on ``dcp_rank`` (token i on rank i % size)."""
    if not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank {dcp_rank} out of range for dcp_size {dcp_size}")
    return max(0, (num_tokens - dcp_rank + dcp_size - 1) // dcp_size)


class PagedKVCache:
    """Paged KV storage for layers ``[layer_start, layer_end)`` plus a free-list page allocator.

    Per layer, K and V are ``[num_pages, page_size, num_kv_heads, head_dim]`` in ``config.dtype``.
    The transfer layer sees 2 * (layer_end - layer_start) *entries* in the fixed order
    layer.K, layer.V, next layer.K, …; each entry viewed as uint8 rows
    ``[num_pages * page_size, bytes_per_token]`` (``entry_rows``) aliases the cache memory.

    Raises:
        ValueError: non-positive ``num_pages``/``page_size`` or a layer range outside the model.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int = 16,
        layers: tuple[int, int] | None = None,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        start, end = layers if layers is not None else (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside [0, {config.num_layers})")
        self.config = config
        self.num_pages = num_pages
        self.page_size = page_size
        self.layer_start = start
        self.layer_end = end
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        self._entries = [
            torch.zeros(shape, dtype=config.torch_dtype) for _ in range(2 * (end - start))
        ]
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = [True] * num_pages

    # -- allocator -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Free pages."""
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor:
        """Take ``n`` pages (lowest-freed-first order). Returns int64 [n] page ids.

        Raises OutOfPagesError when fewer than ``n`` pages are free (allocates nothing);
        ValueError when ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"alloc({n}): n must be >= 0")
        if n > len(self._free):
            raise OutOfPagesError(f"alloc({n}): only {len(self._free)} of {self.num_pages} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._is_free[i] = False
        return torch.tensor(ids, dtype=torch.int64)

    def free(self, ids: torch.Tensor | Sequence[int]) -> None:
        """Return pages to the free list. Raises ValueError on an out-of-range, duplicate or
        already-free id (nothing is freed then)."""
        lst = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        if len(set(lst)) != len(lst):
            raise ValueError(f"free(): duplicate page ids in {lst}")
        for i in lst:
            if not 0 <= i < self.num_pages:
                raise ValueError(f"free(): page id {i} out of range [0, {self.num_pages})")
            if self._is_free[i]:
                raise ValueError(f"free(): page {i} is already free")
        for i in lst:
            self._is_free[i] = True
            self._free.append(i)

    # -- storage -----------------------------------------------------------------------------------
    def _index(self, layer: int) -> int:
        if not self.layer_start <= layer < self.layer_end:
            raise ValueError(f"layer {layer} not in [{self.layer_start}, {self.layer_end})")
        return 2 * (layer - self.layer_start)

    def k(self, layer: int) -> torch.Tensor:
        """K of global layer ``layer``: [num_pages, page_size, num_kv_heads, head_dim]."""
        return self._entries[self._index(layer)]

    def v(self, layer: int) -> torch.Tensor:
        """V of global layer ``layer``: [num_pages, page_size, num_kv_heads, head_dim]."""
        return self._entries[self._index(layer) + 1]

    def entry_tensors(self) -> list[torch.Tensor]:
        """Contiguous per-entry tensors in order layer.K, layer.V, … (the live storage)."""
        return list(self._entries)

    def entry_bytes_per_token(self) -> list[int]:
        """Bytes per token row of each entry (``num_kv_heads * head_dim * itemsize``)."""
        return [self.config.kv_bytes_per_token] * len(self._entries)

    def entry_rows(self) -> list[torch.Tensor]:
        """Each entry as uint8 rows [num_pages * page_size, bytes_per_token], aliasing the cache;
        row ``slot`` is the token at that flat slot (see ``slot_mapping``)."""
        rows = self.num_pages * self.page_size
        return [e.view(torch.uint8).view(rows, -1) for e in self._entries]


@dataclass(frozen=True)
class SeqSpan:
    """New tokens of one request in a forward batch: positions ``[start, start + length)``.

    ``page_ids`` (int64 [n]) is the request's page list on this cache, covering at least
    ``start + length`` tokens; positions ``[0, start)`` must already hold valid K/V (an earlier
    chunk or a prefix-cache hit).
    """

    page_ids: torch.Tensor
    start: int
    length: int


def slot_mapping(page_ids: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat cache slots for ``positions`` (int64 [n]) of a request with pages ``page_ids``:
    ``page_ids[pos // page_size] * page_size + pos % page_size``. Returns int64 [n].

    Raises ValueError when a position falls beyond the page list.
    """
    if positions.numel() and int(positions.max()) >= page_ids.numel() * page_size:
        raise ValueError(
            f"position {int(positions.max())} beyond {page_ids.numel()} pages of {page_size} tokens"
        )
    return page_ids.to(torch.int64)[positions // page_size] * page_size + positions % page_size


# -- building blocks -------------------------------------------------------------------------------
def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; rotate-half convention.
    ang = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _qkv(
    model: TinyLlama, lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = model.config
    t = x.shape[0]
    qkv = _rms_norm(x, lw.attn_norm, cfg.rms_eps) @ lw.wqkv
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q = qkv[:, :nq].reshape(t, cfg.num_heads, cfg.head_dim)
    k = qkv[:, nq : nq + nkv].reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, nq + nkv :].reshape(t, cfg.num_kv_heads, cfg.head_dim)
    return _rope(q, positions, model.inv_freq), _rope(k, positions, model.inv_freq), v


def _finish_layer(
    model: TinyLlama, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor
) -> torch.Tensor:
    # attn: [T, num_heads, head_dim]; output projection, residual, SwiGLU MLP, residual.
    x = x + attn.reshape(x.shape[0], -1) @ lw.wo
    gate, up = (_rms_norm(x, lw.mlp_norm, model.config.rms_eps) @ lw.w_gate_up).chunk(2, dim=-1)
    return x + (torch.nn.functional.silu(gate) * up) @ lw.w_down


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query softmax attention returning the output and its log-sum-exp.

    Args:
        q: [T, num_heads, D]; k, v: [S, num_kv_heads, D] (same dtype as q).
        q_pos, k_pos: int64 [T] and [S] token positions, ``k_pos`` ascending; key j is visible
            to query t iff ``k_pos[j] <= q_pos[t]``. Both None: every key is visible (DCP
            partials).

    Returns:
        ``(out [T, num_heads, D], lse [T, num_heads])`` where lse is the natural-log sum of
        exp(scaled scores) over visible keys. ``S == 0`` gives zeros and lse = -inf, which
        ``merge_attention`` weights as zero. Each query must see at least one key otherwise.
    """
    t, h, d = q.shape
    s, kvh, _ = k.shape
    if s == 0:
        return q.new_zeros(t, h, d), q.new_full((t, h), -math.inf)
    g = h // kvh
    causal = (q_pos, k_pos) if q_pos is not None and k_pos is not None else None
    qg = (q * (1.0 / math.sqrt(d))).reshape(t, kvh, g, d).permute(1, 2, 0, 3)  # [kvh, g, T, D]
    kt = k.permute(1, 2, 0).unsqueeze(1)  # [kvh, 1, D, S]
    vv = v.permute(1, 0, 2).unsqueeze(1)  # [kvh, 1, S, D]
    out = q.new_empty(kvh, g, t, d)
    lse = q.new_empty(kvh, g, t)
    for t0 in range(0, t, _Q_BLOCK):
        t1 = min(t, t0 + _Q_BLOCK)
        s1 = s
        if causal is not None:
            # Keys are sorted, so keys past the block's last query are invisible: skip them.
            qp, kp = causal[0][t0:t1], causal[1]
            s1 = int(torch.searchsorted(kp, qp.max(), right=True))
        scores = torch.matmul(qg[:, :, t0:t1], kt[..., :s1])  # [kvh, g, tb, s1]
        if causal is not None:
            scores.masked_fill_(kp[None, :s1] > qp[:, None], -math.inf)
        m = scores.amax(dim=-1, keepdim=True)
        p = scores.sub_(m).exp_()
        denom = p.sum(dim=-1, keepdim=True)
        out[:, :, t0:t1] = torch.matmul(p, vv[:, :, :s1]).div_(denom)
        lse[:, :, t0:t1] = (m + torch.log(denom)).squeeze(-1)
    return out.permute(2, 0, 1, 3).reshape(t, h, d), lse.permute(2, 0, 1).reshape(t, h)


def merge_attention(
    outs: Sequence[torch.Tensor] | torch.Tensor, lses: Sequence[torch.Tensor] | torch.Tensor
) -> torch.Tensor:
    """Merge partial attention outputs over disjoint key sets using their log-sum-exp.

    Args:
        outs: P partials, each [..., num_heads, D] (or one stacked [P, ..., num_heads, D]).
        lses: P matching [..., num_heads] (or stacked [P, ..., num_heads]); -inf = empty partial.

    Returns:
        [..., num_heads, D]: ``sum_p exp(lse_p - M) out_p / sum_p exp(lse_p - M)`` with
        ``M = max_p lse_p``, summed in rank order (identical on every rank given the same list).
    """
    o = torch.stack(list(outs)) if not isinstance(outs, torch.Tensor) else outs
    lse = torch.stack(list(lses)) if not isinstance(lses, torch.Tensor) else lses
    m = lse.amax(dim=0, keepdim=True)
    w = torch.exp(lse - m)  # [P, ..., H]; empty partials (-inf) weigh 0
    return (w.unsqueeze(-1) * o).sum(dim=0) / w.sum(dim=0).unsqueeze(-1)


# -- forward passes --------------------------------------------------------------------------------
def embed(model: TinyLlama, token_ids: torch.Tensor) -> torch.Tensor:
    """Token ids (int64 [T]) → hidden states [T, hidden] ``compute_dtype``.

    Raises ValueError on an id outside ``[0, vocab)``."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= model.config.vocab):
        raise ValueError(f"token id outside [0, {model.config.vocab}): {ids.tolist()[:8]}…")
    return model.embed[ids]


def final_logits(model: TinyLlama, hidden: torch.Tensor) -> torch.Tensor:
    """Final RMSNorm + LM head: hidden [N, hidden] → logits [N, vocab] ``compute_dtype``."""
    return _rms_norm(hidden, model.final_norm, model.config.rms_eps) @ model.lm_head


def run_layers(
    model: TinyLlama, cache: PagedKVCache, hidden: torch.Tensor, spans: Sequence[SeqSpan]
) -> torch.Tensor:
    """Run layers ``[cache.layer_start, cache.layer_end)`` over a batch of request spans.

    This is one PP rank's work for a prefill chunk (or a plain decode step): K/V of the new
    tokens are written into ``cache`` at their slots, then each new token attends causally over
    its request's positions ``[0, pos]`` read back from the cache.

    Args:
        hidden: [sum(span.length), hidden] ``compute_dtype``, rows in span order (from ``embed``
            on the first rank, from the previous rank otherwise).
        spans: one ``SeqSpan`` per request in the batch (page ids on *this* cache).

    Returns:
        Hidden states [sum(span.length), hidden] after the last layer of the range (before the
        final norm; pass them to the next rank, or to ``final_logits`` on the last rank).

    Raises:
        ValueError: row count mismatch, or a span not covered by its pages.
    """
    total = sum(s.length for s in spans)
    if hidden.shape[0] != total:
        raise ValueError(f"hidden has {hidden.shape[0]} rows, spans cover {total} tokens")
    if not spans:
        return hidden.to(model.config.torch_compute_dtype)
    ps = cache.page_size
    positions = [torch.arange(s.start, s.start + s.length, dtype=torch.int64) for s in spans]
    ctx_pos = [torch.arange(s.start + s.length, dtype=torch.int64) for s in spans]
    ctx_slots = [slot_mapping(s.page_ids, p, ps) for s, p in zip(spans, ctx_pos)]
    new_slots = torch.cat([c[s.start :] for s, c in zip(spans, ctx_slots)])
    all_pos = torch.cat(positions)
    cdt, kvdt = model.config.torch_compute_dtype, model.config.torch_dtype
    x = hidden.to(cdt)
    with torch.no_grad():
        for layer in range(cache.layer_start, cache.layer_end):
            lw = model.layers[layer]
            q, k, v = _qkv(model, lw, x, all_pos)
            kf = cache.k(layer).view(-1, *k.shape[1:])
            vf = cache.v(layer).view(-1, *v.shape[1:])
            kf[new_slots] = k.to(kvdt)
            vf[new_slots] = v.to(kvdt)
            outs, row = [], 0
            for span, slots, kpos, qpos in zip(spans, ctx_slots, ctx_pos, positions):
                o, _ = attention(
                    q[row : row + span.length], kf[slots].to(cdt), vf[slots].to(cdt), qpos, kpos
                )
                outs.append(o)
                row += span.length
            x = _finish_layer(model, lw, x, torch.cat(outs))
    return x


def _last_rows(spans: Sequence[SeqSpan]) -> torch.Tensor:
    ends = torch.tensor([s.length for s in spans], dtype=torch.int64).cumsum(0)
    return ends - 1


def _require_full(model: TinyLlama, cache: PagedKVCache) -> None:
    if (cache.layer_start, cache.layer_end) != (0, model.config.num_layers):
        raise ValueError(
            f"cache holds layers [{cache.layer_start}, {cache.layer_end}); this call needs all "
            f"{model.config.num_layers} (use embed/run_layers/final_logits per PP rank)"
        )


def forward(
    model: TinyLlama, cache: PagedKVCache, token_ids: torch.Tensor, spans: Sequence[SeqSpan]
) -> torch.Tensor:
    """All layers in one process: token ids int64 [sum(length)] → logits of each span's last
    token [len(spans), vocab] ``compute_dtype``. Raises ValueError if ``cache`` lacks layers or
    any span has length 0."""
    _require_full(model, cache)
    if any(s.length < 1 for s in spans):
        raise ValueError("every span needs at least one new token")
    hidden = run_layers(model, cache, embed(model, token_ids), spans)
    with torch.no_grad():
        return final_logits(model, hidden[_last_rows(spans)])


def prefill_chunk(
    model: TinyLlama,
    cache: PagedKVCache,
    token_ids: torch.Tensor,
    page_ids: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """Prefill one request's tokens at positions ``[start, start + len(token_ids))`` (chunked
    prefill or a prefix-cache suffix; positions ``[0, start)`` already in ``cache``).

    Returns logits of the chunk's last token, [vocab] ``compute_dtype``."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    return forward(model, cache, ids, [SeqSpan(page_ids, start, ids.numel())])[0]


def decode_step(
    model: TinyLlama,
    cache: PagedKVCache,
    token_ids: torch.Tensor,
    page_ids: Sequence[torch.Tensor],
    positions: Sequence[int],
) -> torch.Tensor:
    """One decode step for a batch (no DCP): request b feeds ``token_ids[b]`` at position
    ``positions[b]`` (= tokens already cached). Returns logits [B, vocab] ``compute_dtype``."""
    spans = [SeqSpan(p, int(pos), 1) for p, pos in zip(page_ids, positions, strict=True)]
    return forward(model, cache, torch.as_tensor(token_ids, dtype=torch.int64), spans)


GatherFn = Callable[[torch.Tensor], list[torch.Tensor]]


def decode_step_dcp(
    model: TinyLlama,
    cache: PagedKVCache,
    token_ids: torch.Tensor,
    page_ids: Sequence[torch.Tensor],
    positions: Sequence[int],
    dcp_rank: int,
    dcp_size: int,
    gather_fn: GatherFn,
) -> torch.Tensor:
    """One decode step on DCP rank ``dcp_rank`` of ``dcp_size`` (all layers, full weights).

    Request b feeds ``token_ids[b]`` at global position ``pos = positions[b]``; its tokens
    ``[0, pos)`` sit on their owners (token i on rank i % dcp_size at local offset
    i // dcp_size, addressed through ``page_ids[b]``, this rank's local page list). Per layer:
    q/k/v for the new token on every rank; its K/V written only on rank ``pos % dcp_size``;
    partial attention over local tokens; ``gather_fn`` exchanges partials; LSE merge; the rest
    of the layer is identical on every rank.

    Args:
        gather_fn: collective all-gather; called once per layer with a ``compute_dtype`` tensor
            [B, num_heads * (head_dim + 1)] (partial outputs then LSEs) and must return the
            ``dcp_size`` tensors of all ranks in rank order (e.g. ``dist.all_gather`` on gloo).
            Every rank must call this with the same batch.

    Returns:
        Logits [B, vocab] ``compute_dtype`` (identical on every rank).

    Raises:
        ValueError: bad rank/size, pages too short for the local share, or a gather result
            of the wrong length or shape.
    """
    cfg = model.config
    if not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank {dcp_rank} out of range for dcp_size {dcp_size}")
    _require_full(model, cache)
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    pos_list = [int(p) for p in positions]
    if not len(pos_list) == len(page_ids) == ids.numel():
        raise ValueError("token_ids, page_ids and positions must have one entry per request")
    b, h, d, ps = ids.numel(), cfg.num_heads, cfg.head_dim, cache.page_size
    cdt, kvdt = cfg.torch_compute_dtype, cfg.torch_dtype
    # Local slots of each request's share including the new token when this rank owns it.
    local_slots = [
        slot_mapping(
            pg, torch.arange(dcp_local_len(pos + 1, dcp_rank, dcp_size), dtype=torch.int64), ps
        )
        for pg, pos in zip(page_ids, pos_list)
    ]
    owned = [i for i, pos in enumerate(pos_list) if pos % dcp_size == dcp_rank]
    owned_idx = torch.tensor(owned, dtype=torch.int64)
    owned_slots = torch.stack([local_slots[i][-1] for i in owned]) if owned else owned_idx
    all_pos = torch.tensor(pos_list, dtype=torch.int64)
    with torch.no_grad():
        x = embed(model, ids)
        for layer in range(cfg.num_layers):
            lw = model.layers[layer]
            q, k, v = _qkv(model, lw, x, all_pos)
            kf = cache.k(layer).view(-1, cfg.num_kv_heads, d)
            vf = cache.v(layer).view(-1, cfg.num_kv_heads, d)
            if owned:
                kf[owned_slots] = k[owned_idx].to(kvdt)
                vf[owned_slots] = v[owned_idx].to(kvdt)
            part_out = q.new_empty(b, h, d)
            part_lse = q.new_empty(b, h)
            for i, slots in enumerate(local_slots):
                o, lse = attention(q[i : i + 1], kf[slots].to(cdt), vf[slots].to(cdt))
                part_out[i], part_lse[i] = o[0], lse[0]
            packed = torch.cat([part_out.reshape(b, h * d), part_lse], dim=1)
            parts = gather_fn(packed)
            if len(parts) != dcp_size or any(p.shape != packed.shape for p in parts):
                raise ValueError(
                    f"gather_fn returned {len(parts)} tensors of shapes "
                    f"{[tuple(p.shape) for p in parts]}; expected {dcp_size} of "
                    f"{tuple(packed.shape)}"
                )
            stacked = torch.stack([p.to(cdt) for p in parts])  # [P, B, H*D + H]
            merged = merge_attention(
                stacked[:, :, : h * d].reshape(dcp_size, b, h, d), stacked[:, :, h * d :]
            )
            x = _finish_layer(model, lw, x, merged)
        return final_logits(model, x)


def forward_dense(model: TinyLlama, token_ids: torch.Tensor) -> torch.Tensor:
    """One-shot causal forward without a paged cache (the test oracle).

    K/V are rounded through ``config.dtype`` exactly as the cache would, so this matches the
    paged paths. Token ids int64 [T] → logits [T, vocab] ``compute_dtype``."""
    cfg = model.config
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    pos = torch.arange(ids.numel(), dtype=torch.int64)
    cdt, kvdt = cfg.torch_compute_dtype, cfg.torch_dtype
    with torch.no_grad():
        x = embed(model, ids)
        for lw in model.layers:
            q, k, v = _qkv(model, lw, x, pos)
            o, _ = attention(q, k.to(kvdt).to(cdt), v.to(kvdt).to(cdt), pos, pos)
            x = _finish_layer(model, lw, x, o)
        return final_logits(model, x)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: argmax over the last dim, ties to the lowest token id.

    logits [..., vocab] → int64 [...]. (torch.argmax returns the first maximal index on CPU; the
    explicit equality mask keeps that guarantee independent of backend.)

    Raises ValueError when a row contains NaN."""
    top = logits.amax(dim=-1, keepdim=True)
    if bool(torch.isnan(top).any()):
        raise ValueError("greedy(): logits contain NaN")
    is_top = logits == top
    idx = torch.arange(logits.shape[-1], dtype=torch.int64).expand_as(logits)
    return torch.where(is_top, idx, logits.shape[-1]).amin(dim=-1)
