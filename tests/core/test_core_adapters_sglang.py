"""The SGLang adapter's pure parts (no SGLang needed): planes from SGLang's ``KVArgs`` lists,
the merged room status, the settings from the environment, the Enum extension."""

from __future__ import annotations

import enum

import pytest

from pdplug.adapters.sglang import add_enum_member
from pdplug.adapters.sglang.planes import RankShape, kv_plane, row_plane, state_planes
from pdplug.adapters.sglang.rooms import first_failure, merge_polls
from pdplug.adapters.sglang.settings import settings_from
from pdplug.heads import expected_sources, fed_ranks
from pdplug.types import KVPoll


def test_kv_plane_pairs_k_and_v_per_layer() -> None:
    # SGLang MHA: K of layers 0..2, then V of layers 0..2; page 16 tokens, 256 B per token
    ptrs = [1000, 2000, 3000, 4000, 5000, 6000]
    plane = kv_plane(ptrs, [4096] * 6, [16 * 256] * 6, page_size=16, shape=RankShape(first_layer=2))
    assert [r.address for r in plane.regions] == [1000, 4000, 2000, 5000, 3000, 6000]
    assert {r.page_stride for r in plane.regions} == {4096}
    lay = plane.layout
    assert lay.entry_bytes_per_token == (256,) * 6
    assert (lay.page_size, lay.num_layers, lay.first_layer, lay.kind) == (16, 3, 2, "nhd")


def test_kv_plane_mla_and_refusals() -> None:
    plane = kv_plane([1, 2], [64, 64], [32, 32], page_size=1, shape=RankShape(is_mla=True))
    assert [r.address for r in plane.regions] == [1, 2] and plane.layout.kind == "mla"
    with pytest.raises(ValueError, match="K and V per layer"):
        kv_plane([1, 2, 3], [64] * 3, [32] * 3, page_size=1, shape=RankShape())
    with pytest.raises(ValueError, match="num_draft_entries=2"):
        kv_plane([1, 2], [64] * 2, [32] * 2, page_size=1, shape=RankShape(), num_draft_entries=2)
    with pytest.raises(ValueError, match=r"kv_item_lens\[0\]=30 bytes"):
        kv_plane([1, 2], [64] * 2, [30] * 2, page_size=4, shape=RankShape())
    with pytest.raises(ValueError, match="as many"):
        kv_plane([1, 2], [64], [32, 32], page_size=1, shape=RankShape())


def test_dcp_decode_shares_kv_heads() -> None:
    # attention TP 2 with DCP 2: one KV-TP rank, two DCP ranks
    s = RankShape(attn_tp_size=2, attn_tp_rank=1, dcp_size=2, dcp_rank=1)
    lay = kv_plane([1, 2], [64] * 2, [32] * 2, page_size=1, shape=s).layout
    assert (lay.tp_size, lay.tp_rank, lay.dcp_size, lay.dcp_rank) == (1, 0, 2, 1)


def test_row_plane_every_decode_rank_gets_the_metadata_row() -> None:
    prefill = row_plane("aux", [10, 20], [640, 160], [64, 16], shape=RankShape())
    decode = [
        row_plane(
            "aux", [10, 20], [640, 160], [64, 16], shape=RankShape(attn_tp_size=2, attn_tp_rank=r)
        )
        for r in range(2)
    ]
    assert prefill.layout.page_size == 1 and prefill.layout.entry_bytes_per_token == (64, 16)
    assert fed_ranks(prefill.layout, 2, decode[0].layout) == (0, 1)
    assert [expected_sources(d.layout, 1, prefill.layout) for d in decode] == [(0,), (0,)]


def test_state_planes_replicated_or_sharded() -> None:
    s = RankShape(attn_tp_size=2, attn_tp_rank=1)
    planes = state_planes(
        ["mamba", "swa", "empty"], [[1, 2], [3], []], [[96, 160], [64], []], [[48, 80], [32], []],
        [[0, 0], [4], []], shape=s,
    )  # fmt: skip
    assert [p.name for p in planes] == ["state:mamba", "state:swa"]
    assert planes[0].layout.kind == "mla" and planes[1].layout.kind == ""
    with pytest.raises(ValueError, match="as many"):
        state_planes(["mamba"], [], [], [], None, shape=s)


def test_merge_polls() -> None:
    P = KVPoll
    assert merge_polls([P.Success, P.Success]) == P.Success
    assert merge_polls([P.Success, P.Transferring]) == P.Transferring
    assert merge_polls([P.WaitingForInput, P.Bootstrapping]) == P.Bootstrapping
    assert merge_polls([P.Success, P.Failed], drained=True) == P.Failed
    assert merge_polls([P.Success, P.Failed], drained=False) == P.Transferring
    with pytest.raises(ValueError):
        merge_polls([])
    assert first_failure([("adapter", None), ("kv", "peer dead"), ("aux", "x")]) == "kv: peer dead"
    assert first_failure([("kv", None)]) is None


def test_settings_from_the_environment(tmp_path) -> None:
    s = settings_from({}, host="127.0.0.1", chunked_prefill_size=4096)
    assert s.chunk_tokens == 4096 and s.net.wire.hmac_key is None and s.bootstrap_timeout_s == 300
    key = tmp_path / "key"
    key.write_bytes(b"secret\n")
    env = {
        "PDPLUG_SGLANG_KEY_FILE": str(key),
        "PDPLUG_SGLANG_BIND_HOST": "0.0.0.0",
        "PDPLUG_SGLANG_ADVERTISE_HOST": "10.1.2.3",
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "12",
        "PDPLUG_SGLANG_PACK_REGION_TOKENS": "512",
    }
    s = settings_from(env, host="127.0.0.1", chunked_prefill_size=None)
    assert s.net.wire.hmac_key == b"secret" and s.net.advertise_host == "10.1.2.3"
    assert (s.bootstrap_timeout_s, s.pack_region_tokens, s.chunk_tokens) == (12.0, 512, 8192)
    with pytest.raises(ValueError, match="PDPLUG_SGLANG_ADVERTISE_HOST"):
        settings_from({}, host="0.0.0.0", chunked_prefill_size=None)
    with pytest.raises(ValueError, match="PDPLUG_SGLANG_KEY_FILE"):
        settings_from(
            {"PDPLUG_SGLANG_ADVERTISE_HOST": "10.1.2.3"}, host="0.0.0.0", chunked_prefill_size=None
        )
    with pytest.raises(ValueError, match="PDPLUG_SGLANG_TRANSFER_TIMEOUT_S='-1' must be > 0"):
        settings_from(
            {"PDPLUG_SGLANG_TRANSFER_TIMEOUT_S": "-1"}, host="127.0.0.1", chunked_prefill_size=None
        )
    with pytest.raises(ValueError, match="PDPLUG_SGLANG_CHUNK_TOKENS='x' is not a whole number"):
        settings_from(
            {"PDPLUG_SGLANG_CHUNK_TOKENS": "x"}, host="127.0.0.1", chunked_prefill_size=None
        )


def test_add_enum_member_keeps_the_class() -> None:
    class Backend(enum.Enum):
        MOONCAKE = "mooncake"

    m = add_enum_member(Backend, "PDPLUG", "pdplug")
    assert Backend("pdplug") is m is Backend.PDPLUG is Backend["PDPLUG"]
    assert list(Backend) == [Backend.MOONCAKE, Backend.PDPLUG]
    assert add_enum_member(Backend, "PDPLUG", "pdplug") is m
