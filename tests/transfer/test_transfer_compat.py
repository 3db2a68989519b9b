"""The handshake carries what a host checks compatibility with, and both sides name every
mismatch they cannot map (real engines, real sockets on 127.0.0.1)."""

from __future__ import annotations

import pytest
import torch
from _rig import kv_config, rendezvous

from pdplug import CompatError, KVLayout, PluginManager
from pdplug.bootstrap import resolve
from pdplug.geometry import make_layout
from pdplug.layout import layout_mismatches
from pdplug.transfer.handshake import check_prefill_peer, layout_compat

pytestmark = pytest.mark.timeout(120)


def _layout(**kw: object) -> KVLayout:
    args: dict[str, object] = dict(
        kind="hnd", page_size=16, num_layers=4, head_bytes=256, num_kv_heads=4, head_size=64,
        dtype="bfloat16", model="llama-a", engine="vllm", engine_version="0.32.0",
    )  # fmt: skip
    args.update(kw)
    return make_layout(**args)  # type: ignore[arg-type]


def _kv(lay: KVLayout, pages: int = 8) -> list[torch.Tensor]:
    n = pages * lay.page_size
    return [torch.zeros(n * b, dtype=torch.uint8) for b in lay.entry_bytes_per_token]


FIELDS = ("model", "dtype", "num_kv_heads", "head_size", "page_size", "layers")


def test_every_mismatch_is_named_by_both_sides(backend: str) -> None:
    """A decode rank of another model, dtype, head count, head size, page size (neither divides
    the other), layer range and a DCP size beyond the prefill's pack buffer: the prefill rank
    refuses naming every field, the decode rank's own check names them too, and ``connect``
    raises one CompatError with all of them. The fields ride the handshake (``PeerInfo``)."""
    src = _layout()
    bad = _layout(
        model="llama-b", dtype="float16", num_kv_heads=8, head_size=128, head_bytes=512,
        page_size=24, first_layer=2, dcp_size=8,
    )  # fmt: skip
    with rendezvous() as srv:
        pm = PluginManager()
        s = pm.make_kv_sender(kv_config("prefill", src, srv.endpoint, "p"), name=backend)
        rc = pm.make_kv_receiver(kv_config("decode", bad, srv.endpoint, "d"), name=backend)
        skv, dkv = _kv(src), _kv(bad)
        try:
            s.register_kv(skv)
            rc.register_kv(dkv)
            (peer,) = resolve(srv.endpoint, "p", timeout_s=20)
            lay = peer.layout  # what the handshake carries
            assert (lay.model, lay.dtype, lay.num_kv_heads, lay.head_size) == (
                "llama-a", "bfloat16", 4, 64
            )  # fmt: skip
            assert (lay.first_layer, lay.num_layers, lay.page_size, lay.kind) == (0, 4, 16, "hnd")
            assert (lay.engine, lay.engine_version) == ("vllm", "0.32.0")
            with pytest.raises(CompatError) as err:
                rc.connect([peer])
            got = err.value.mismatches
            theirs = [m for m in got if "rank 0 refused: " in m]
            for f in (*FIELDS, "dcp_size"):
                assert any(f in m for m in theirs), (f, got)
            assert s.stats()["refused"] == 1
            mine = check_prefill_peer(rc.peer_info(), peer, backend=backend, compat=layout_compat)
            for f in FIELDS:
                assert any(f in m for m in mine), (f, mine)
        finally:
            rc.close()
            s.close()


def test_what_can_be_mapped_is_not_a_mismatch() -> None:
    """NHD <-> HND, a page ratio, another TP size with routable heads, other engines' versions
    and layout kinds: nothing to refuse (the planner maps them)."""
    src = _layout(tp_size=2, tp_rank=1, page_size=32, engine_version="0.33.0")
    dst = _layout(kind="nhd", head_bytes=256, page_size=16, dcp_size=2, engine="sglang")
    assert layout_mismatches(src, dst) == []
    assert layout_mismatches(dst, src) == []
