"""Drive vLLM's real ``Scheduler`` with PdplugConnector and model-runner outputs made here.

vLLM's own connector tests do the same (tests/v1/kv_connector/unit/utils.py in the vLLM
repository): build a ``VllmConfig`` for a CPU device, a ``Scheduler`` with a one-group KV
cache, add ``Request`` s, and feed ``update_from_output`` with ``ModelRunnerOutput`` s whose
``kv_connector_output`` says what the workers would report. Written for vLLM 0.32.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from pdplug.adapters.vllm import register
from pdplug.adapters.vllm.connector import PdplugConnector, PdplugConnectorMetadata
from pdplug.adapters.vllm.scheduler import StepPlan
from pdplug.ports import free_ports

BLOCK = 32
EOS = 2
_hash_ready = False
#: every scheduler made here; the conftest shuts them down after each test
made: list[Scheduler] = []


def make_scheduler(
    model: str,
    role: str,
    *,
    num_blocks: int = 200,
    batched_tokens: int = 128,
    policy: str = "fail",
    extra: dict[str, Any] | None = None,
    async_scheduling: bool = False,
    kv_cache_fields: dict[str, Any] | None = None,
) -> Scheduler:
    """A real vLLM Scheduler whose connector is PdplugConnector (``role``: prefill/decode).

    ``async_scheduling`` makes vLLM keep two steps in flight (``max_concurrent_batches`` 2, as
    with PP); ``kv_cache_fields`` are extra ``KVCacheConfig`` fields of the installed vLLM.
    """
    register()
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    cfg_extra: dict[str, Any] = {"instance": f"{role}-0"}
    if role == "prefill":
        (cfg_extra["bootstrap_port"],) = free_ports(1)
    cfg_extra.update(extra or {})
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", seed=0, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=batched_tokens,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdplugConnector",
            kv_role=kv_role,
            engine_id=f"{role}-0",
            kv_connector_extra_config=cfg_extra,
            kv_load_failure_policy=policy,
        ),
        device_config=DeviceConfig("cpu"),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32
                ),
            )
        ],
        **(kv_cache_fields or {}),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    # vLLM's CPU platform turns async scheduling off when the config is validated (GPU engines
    # default to it on); the scheduler's logic does not depend on the platform
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    sched = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )
    assert isinstance(sched.connector, PdplugConnector)
    made.append(sched)
    return sched


def make_request(
    rid: str,
    tokens: list[int],
    params: dict[str, Any] | None,
    max_tokens: int = 1,
) -> Request:
    """A vLLM Request with token-id prompt ``tokens`` and ``kv_transfer_params``."""
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
    sp.update_from_generation_config({}, EOS)
    req = Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    req.kv_transfer_params = params
    return req


def runner_output(
    reqs: Iterable[Request],
    *,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
    token: int = 7,
) -> ModelRunnerOutput:
    """What the workers return for one step: one sampled token per request in ``reqs`` (none
    for a request still mid-prefill, as vLLM's model runner does), and the connector's
    reports."""
    reqs = list(reqs)
    ids = [r.request_id for r in reqs]
    kv = None
    if finished_sending or finished_recving or failed_recving:
        kv = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            failed_recving=failed_recving or set(),
        )
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[] if r.is_prefill_chunk else [token] for r in reqs],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv,
    )


def plan_of(scheduler_output: Any) -> StepPlan:
    """The StepPlan the scheduler handed the workers this step."""
    meta = scheduler_output.kv_connector_metadata
    assert isinstance(meta, PdplugConnectorMetadata)
    return meta.plan


def assert_scheduler_empty(s: Scheduler) -> None:
    """No request, no held block, no connector state left (vLLM's no-leak check)."""
    assert not s.requests and not s.running and len(s.waiting) == 0
    assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
    mgr = s.kv_cache_manager.coordinator.single_type_managers[0]
    assert not mgr.req_to_blocks
    pool = s.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    conn = s.connector
    assert isinstance(conn, PdplugConnector)
    book = conn.book
    assert not book.rooms and not book.prefill and not book.decode and not book.held
    assert not book.errors and not book.has_pending_push_work()


class InFlight:
    """Steps kept in flight as vLLM's engine core does with async scheduling or PP
    (``EngineCore.step_with_batch_queue``): ``schedule()`` runs ahead of
    ``update_from_output`` for the oldest step.

    :param s: the scheduler.
    :param reqs: every request the test adds (outputs are made for those scheduled).
    """

    def __init__(self, s: Scheduler, reqs: Iterable[Request]) -> None:
        self.s = s
        self.reqs = {r.request_id: r for r in reqs}
        self.queue: list[Any] = []

    def schedule(self) -> StepPlan:
        """Schedule one more step; returns the plan the workers get for it."""
        so = self.s.schedule()
        self.queue.append(so)
        return plan_of(so)

    def finish(self, **reports: Any) -> dict[str, Any]:
        """The oldest step in flight ends with the workers' ``reports``; returns the requests
        that finished, by id."""
        so = self.queue.pop(0)
        scheduled = [self.reqs[r] for r in so.num_scheduled_tokens]
        outs = self.s.update_from_output(so, runner_output(scheduled, **reports))
        return {o.request_id: o for v in outs.values() for o in v.outputs if o.finish_reason}
