"""pdplug as a vLLM general plugin: found by vLLM's own loader, idempotent, refusing what it
cannot serve with a message that names the problem."""

from __future__ import annotations

import importlib.metadata as md

import pytest
import torch

pytest.importorskip("vllm")

from _sched import make_scheduler
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

import pdplug.adapters.vllm as adapter

pytestmark = pytest.mark.vllm


def test_vllm_loader_finds_pdplug_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    (ep,) = [e for e in md.entry_points(group=DEFAULT_PLUGINS_GROUP) if e.name == "pdplug"]
    assert ep.value == "pdplug.adapters.vllm:register"
    monkeypatch.setenv("VLLM_PLUGINS", "pdplug")  # vLLM's allow list names the entry point
    found = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert list(found) == ["pdplug"] and found["pdplug"] is adapter.register


def test_register_is_idempotent_and_lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    adapter.register()
    adapter.register()  # a second call in the same process is a no-op
    monkeypatch.setattr(adapter, "_registered", False)
    adapter.register()  # the factory already has the name: swallowed, not raised
    from pdplug.adapters.vllm.connector import PdplugConnector

    assert KVConnectorFactory.get_connector_class_by_name("PdplugConnector") is PdplugConnector


def test_register_on_unsupported_vllm_warns_and_still_registers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(adapter, "_registered", False)
    monkeypatch.setattr(adapter, "installed_vllm", lambda: ("vllm", "0.40.1"))
    adapter.register()
    assert "found vllm 0.40.1" in caplog.text and ">=0.32,<0.34" in caplog.text


def _kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"bootstrap_port": 0}, r"bootstrap_port=0 must be a TCP port"),
        ({"bootstrap_port": "x"}, r"got `str` - at `\$\.bootstrap_port`"),
        ({"bootstrap_port": 5555, "transfer_timeout": 5}, r"unknown field `transfer_timeout`"),
        ({"bootstrap_port": 5555, "transfer_timeout_s": "abc"}, r"at `\$\.transfer_timeout_s`"),
        ({"kv_sender": "no-such-sender"}, r"no-such-sender"),
    ],
)
def test_bad_extra_config_is_named(tiny_model: str, extra: dict, match: str) -> None:
    with pytest.raises(Exception, match=match):
        make_scheduler(tiny_model, "prefill", extra=extra)


def test_prefill_serves_the_rendezvous_and_accepts_pp_handshakes(tiny_model: str) -> None:
    from pdplug.bootstrap import resolve
    from pdplug.errors import TransferError

    s = make_scheduler(tiny_model, "prefill")
    conn = s.connector
    endpoint = conn.rendezvous.endpoint
    # served: no rank registered yet, so "not ready", named
    with pytest.raises(TransferError, match=r"prefill-0.*not ready"):
        resolve(endpoint, "prefill-0", timeout_s=0.5)
    # vLLM's default refuses pp_rank > 0; a full grid is accepted, a partial one named
    with pytest.raises(ValueError, match=r"expected every \(pp_rank, tp_rank\)"):
        conn.set_xfer_handshake_metadata_pp_aware({(1, 0): object()})
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): object()})
    assert conn.handshake_ranks == ((0, 0),)
    # a PP-2 prefill engine: both stages' handshakes are taken (vLLM's base would refuse)
    s.vllm_config.parallel_config.pipeline_parallel_size = 2
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): object(), (1, 0): object()})
    assert conn.handshake_ranks == ((0, 0), (1, 0))
    s.shutdown()
    assert conn.rendezvous is None


def test_a_key_file_seals_the_rendezvous_the_prefill_serves(tiny_model: str, tmp_path) -> None:
    """``hmac_key_file``: the rendezvous answers a lookup sealed with the key; one without it
    is dropped (no answer: the lookup times out), so a decode engine needs the same key."""
    from pdplug.bootstrap import resolve
    from pdplug.config import WireConfig
    from pdplug.errors import TransferError

    key = tmp_path / "pdplug.key"
    key.write_text("s3cret-for-the-test\n")
    s = make_scheduler(tiny_model, "prefill", extra={"hmac_key_file": str(key)})
    endpoint = s.connector.rendezvous.endpoint
    try:
        assert s.connector.rendezvous.wire.hmac_key == b"s3cret-for-the-test"
        with pytest.raises(TransferError, match=r"prefill-0.*not ready"):  # answered
            resolve(endpoint, "prefill-0", timeout_s=2.0,
                    wire=WireConfig(hmac_key=b"s3cret-for-the-test"))  # fmt: skip
        with pytest.raises(TransferError) as unkeyed:
            resolve(endpoint, "prefill-0", timeout_s=1.0)
        assert "not ready" not in str(unkeyed.value)  # dropped, never answered
    finally:
        s.shutdown()
