"""``PdplugConnector``: vLLM's ``KVConnectorBase_V1`` mapped onto pdplug (push, PP -> DCP).

vLLM imports this module only when ``kv_transfer_config.kv_connector`` is
``"PdplugConnector"`` (see :func:`pdplug.adapters.vllm.register`); it refuses to load on a
vLLM outside :data:`pdplug.adapters.vllm.SUPPORTED_VLLM` (:data:`pdplug.adapters.vllm.VLLM_GATE`).

Scheduler role (engine core): :class:`pdplug.adapters.vllm.scheduler.PushBook` keeps the
rooms, push jobs and held blocks; each step's :class:`~pdplug.adapters.vllm.scheduler.StepPlan`
goes to the workers as :class:`PdplugConnectorMetadata`. At start-up the connector resolves
the pdplug components it will use (KV sender, pack planner, scheduler, selected by
``kv_connector_extra_config`` or ``PDPLUG_*``) so a missing plugin stops the engine before
its first request.

Worker role: :class:`pdplug.adapters.vllm.worker.PushWorker` registers vLLM's KV tensors
with the selected pdplug KV sender (prefill) or receiver (decode), applies each step's plan
(aborts and preemptions with a bounded wait until drained, receive jobs, send jobs posted after
the forward) and reports rooms that ended and drained as vLLM's transfer results.

The prefill engine's scheduler process serves the rendezvous (``pdplug.bootstrap``) at
``bootstrap_port``, where every prefill rank (each PP stage, each TP rank) publishes itself
and decode ranks resolve the instance; ``set_xfer_handshake_metadata_pp_aware`` accepts the
handshake of every PP stage (vLLM's default refuses ``pp_rank > 0``).

``kv_connector_extra_config`` keys: ``instance`` (this engine's pdplug instance id, default
the vLLM ``engine_id``), ``bootstrap_port`` (prefill: the rendezvous port its scheduler
process serves), ``bootstrap_host`` (interface it binds, default 127.0.0.1), ``kv_sender``,
``pack_planner``, ``scheduler`` (pdplug selections), ``bootstrap_timeout_s``,
``transfer_timeout_s``, ``waiting_timeout_s`` (room deadlines, seconds), ``chunk_tokens``
(split grid, tokens; default the engine's ``max_num_batched_tokens``),
``pack_region_tokens``, and the socket settings ``hmac_key_file`` / ``hmac_key``,
``bind_host``, ``advertise_host`` (:class:`pdplug.adapters.vllm.extra.ExtraConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus

from pdplug.adapters.placement import RankPlacement
from pdplug.adapters.push import SendJob, step_ready
from pdplug.adapters.vllm import VLLM_GATE, installed_vllm
from pdplug.adapters.vllm.extra import ExtraConfig, parse_extra
from pdplug.adapters.vllm.scheduler import PushBook, StepPlan
from pdplug.adapters.vllm.stats import PdplugKVConnectorStats, PdplugPromMetrics
from pdplug.adapters.vllm.worker import PushWorker
from pdplug.adapters.wire import WILDCARD_HOSTS
from pdplug.bootstrap import RendezvousServer

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

VLLM_GATE.require(installed_vllm())

__all__ = ["PdplugConnector", "PdplugConnectorMetadata", "PdplugHandshakeMetadata"]

_COMPLETED = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}


class PdplugConnectorMetadata(KVConnectorMetadata):
    """One engine step's plan for the workers (vLLM carries it on ``SchedulerOutput``).

    :ivar plan: the :class:`~pdplug.adapters.vllm.scheduler.StepPlan`.
    """

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan
        self.applied = False  # set by the worker that applied it (one object per step)


@dataclass
class PdplugHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker reports at vLLM's handshake (the rank publishes its ``PeerInfo`` at the
    rendezvous itself; the scheduler only checks that every ``(pp_rank, tp_rank)`` reported).

    :ivar instance: the engine's pdplug instance id.
    :ivar side: ``"prefill"`` or ``"decode"``.
    :ivar pp_rank/tp_rank: the worker's place.
    """

    instance: str
    side: str
    pp_rank: int
    tp_rank: int


class PdplugConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by pdplug's selected KV sender, pack planner and scheduler.

    :param vllm_config: the engine's config; ``kv_transfer_config.kv_role`` must be
        ``kv_producer`` (prefill) or ``kv_consumer`` (decode).
    :param role: scheduler or worker.
    :param kv_cache_config: the engine's KV cache groups (exactly one group is supported).
    :raises ValueError: ``kv_both``, several KV cache groups, PP or DCP on the wrong side,
        auxiliary outputs (``--enable-return-routed-experts``), or a bad
        ``kv_connector_extra_config`` value (named).
    :raises pdplug.errors.PluginError: a selected pdplug component cannot be built.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv = self._kv_transfer_config
        if kv.kv_role not in _ROLES:
            raise ValueError(
                f"PdplugConnector: kv_role={kv.kv_role!r}; use kv_producer (prefill engine) or "
                "kv_consumer (decode engine)"
            )
        self.side = _ROLES[kv.kv_role]
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                f"PdplugConnector supports one KV cache group, the model has {len(groups)}"
            )
        if vllm_config.aux_output_config.enabled:
            # vLLM refuses this for its own P/D connectors ("PD auxiliary output is not
            # supported"); from 0.33 its AuxOutputSchedulerConnector also caps the external
            # hit to what its store holds (cap_external_hit), which would turn every decode
            # request into a silent local prefill
            raise ValueError(
                "PdplugConnector: --enable-return-routed-experts (aux_output_config) is not "
                "supported with prefill/decode disaggregation"
            )
        extra = parse_extra(kv.kv_connector_extra_config)
        self.instance = extra.instance or str(kv.engine_id)
        par = vllm_config.parallel_config
        if self.side == "prefill" and par.decode_context_parallel_size > 1:
            raise ValueError(
                "PdplugConnector: decode_context_parallel_size="
                f"{par.decode_context_parallel_size} on a kv_producer; DCP is a decode-side "
                "layout (the prefill engine uses PP/TP)"
            )
        self.bootstrap_port = 0
        if self.side == "prefill":
            port = extra.bootstrap_port
            if not 0 < port < 65536:
                raise ValueError(
                    "PdplugConnector: kv_connector_extra_config.bootstrap_port="
                    f"{port!r} must be a TCP port (1-65535) on a kv_producer"
                )
            self.bootstrap_port = port
        self.selections = {k: getattr(extra, k) for k in ("kv_sender", "pack_planner", "scheduler")}
        self._resolve_components()
        self.worker: PushWorker | None = None
        if role == KVConnectorRole.WORKER:
            self.worker = PushWorker(self._placement(vllm_config, extra))
            return
        self.book = PushBook(self.side)
        self.rendezvous: RendezvousServer | None = None
        self.handshake_ranks: tuple[tuple[int, int], ...] = ()
        if self.side == "prefill":
            wire = extra.adapter_wire().wire
            host = extra.bootstrap_host or wire.bind_host
            self.rendezvous = RendezvousServer(
                msgspec.structs.replace(wire, bind_host=host), port=port
            ).start()

    def _placement(self, vllm_config: VllmConfig, extra: ExtraConfig) -> RankPlacement:
        from vllm.distributed import parallel_state as ps

        par, mc = vllm_config.parallel_config, vllm_config.model_config
        dcp = par.decode_context_parallel_size
        aw = extra.adapter_wire()
        host = extra.bootstrap_host or aw.advertise_host
        wire = aw.wire
        if wire.bind_host in WILDCARD_HOSTS:
            # a rank publishes the endpoint its KV channel bound: bind the advertised address,
            # not 0.0.0.0, so decode ranks on other hosts can reach it
            wire = msgspec.structs.replace(wire, bind_host=aw.advertise_host)
        knobs: dict[str, Any] = extra.timeouts()
        if extra.pack_region_tokens is not None:
            knobs["pack_region_tokens"] = extra.pack_region_tokens
        found = installed_vllm()
        return RankPlacement(
            side=self.side, instance=self.instance, model=str(mc.model),
            engine_version=found[1] if found else "",
            num_kv_heads=mc.get_total_num_kv_heads(), head_size=mc.get_head_size(),
            block_size=vllm_config.cache_config.block_size,
            tp_size=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_size=par.pipeline_parallel_size, pp_rank=ps.get_pp_group().rank_in_group,
            dcp_size=dcp, dcp_rank=ps.get_dcp_group().rank_in_group if dcp > 1 else 0,
            bootstrap=f"tcp://{host}:{self.bootstrap_port}" if self.side == "prefill" else "",
            kv_sender=self.selections["kv_sender"], pack_planner=self.selections["pack_planner"],
            scheduler=self.selections["scheduler"],
            chunk_tokens=extra.chunk_tokens
            or int(vllm_config.scheduler_config.max_num_batched_tokens),
            wire=wire, **knobs,
        )  # fmt: skip

    def _resolve_components(self) -> None:
        from pdplug import get_plugin_manager

        pm = get_plugin_manager()
        for point, name in self.selections.items():
            pm.resolve(point, name)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No (vLLM >= 0.33 asks; vLLM then refuses ``--enable-sleep-mode`` with this connector).

        Sleep mode frees the KV cache and maps it again on wake-up, possibly at other
        addresses. pdplug's KV sender and receiver register the KV memory once per session
        (``register_kv``; there is no unregister), the decode ranks' addresses go to every
        prefill rank at the handshake, and prefill ranks write into them (push): following a
        remap needs re-registration, a new handshake and every peer told, which pdplug's
        transfer layer does not offer. vLLM's own NixlPushConnector answers False for the same
        reason.
        """
        return False

    def unregister_kv_caches(self) -> None:
        """Refused (see :meth:`supports_sleep_mode`): vLLM's inherited no-op would leave peers
        writing into memory that sleep mode frees.

        :raises RuntimeError: always.
        """
        raise RuntimeError(
            "PdplugConnector does not support sleep mode: its KV memory stays registered "
            "with its peers for the whole session"
        )

    def restore_kv_caches(self) -> None:
        """Refused, as :meth:`unregister_kv_caches`.

        :raises RuntimeError: always.
        """
        self.unregister_kv_caches()

    # ------------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Request) -> None:
        """Adopt a request whose ``kv_transfer_params`` carry pdplug's document and claim its
        room (:meth:`pdplug.adapters.vllm.scheduler.PushBook.on_new_request`; a malformed or
        duplicate document is recorded: the prefill runs it without transfer, the decode
        fails it)."""
        self.book.on_new_request(
            request.request_id, request.kv_transfer_params, request.num_prompt_tokens
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Decode: ``(prompt tokens beyond the local prefix hit, True)`` once per room (an
        asynchronous load); prefill: ``(0, False)``."""
        return self.book.num_new_matched_tokens(
            request.request_id, request.num_prompt_tokens, num_computed_tokens
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Decode: the request's blocks for ``num_external_tokens`` tokens become its room's
        destination (a :class:`~pdplug.adapters.vllm.scheduler.RecvJob` in the next plan)."""
        block_ids = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self.book.after_alloc(
            request.request_id, block_ids, num_external_tokens, request.num_prompt_tokens
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's plan for the workers: prefill, one
        :class:`~pdplug.adapters.push.SendJob` per scheduled chunk of a request with a room and
        the rooms of preempted requests to abort; both sides, pending receive jobs, aborts and
        cancels."""
        sends: list[SendJob] = []
        if self.side == "prefill":
            so = scheduler_output
            if so.preempted_req_ids:
                self.book.preempted(so.preempted_req_ids)
            for new in so.scheduled_new_reqs:
                job = self.book.scheduled(
                    new.req_id, new.block_ids[0], False, new.num_computed_tokens,
                    so.num_scheduled_tokens[new.req_id],
                )  # fmt: skip
                if job is not None:
                    sends.append(job)
            cached = so.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                groups = cached.new_block_ids[i]
                job = self.book.scheduled(
                    rid, groups[0] if groups else None, rid in cached.resumed_req_ids,
                    cached.num_computed_tokens[i], so.num_scheduled_tokens[rid],
                )  # fmt: skip
                if job is not None:
                    sends.append(job)
        return PdplugConnectorMetadata(self.book.take_plan(sends))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget the rooms the workers reported drained (``finished_sending`` /
        ``finished_recving``)."""
        done = set(connector_output.finished_sending or ())
        done |= set(connector_output.finished_recving or ())
        self.book.finished_transfers(done)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)``: a prefill request whose room got a chunk keeps
        its blocks until every worker reported the room drained; its params name the room and
        the tokens sent, or the error."""
        return self.book.finished(request.request_id, request.status in _COMPLETED)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` (vLLM's ``SupportsHMA`` form; one KV cache group)."""
        return self.book.finished(request.request_id, request.status in _COMPLETED)

    def has_pending_push_work(self) -> bool:
        """Held rooms or plans not yet handed to the workers (keeps vLLM's loop stepping)."""
        return self.book.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """``(0,)``: the one KV cache group PdplugConnector supports."""
        return (0,)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Accept the handshake of every ``(pp_rank, tp_rank)`` (PP prefill is supported).

        pdplug's ranks publish themselves at the rendezvous this process serves, so the
        metadata is only recorded (which ranks reported), never re-served.

        :raises ValueError: the ranks do not form a full ``pp_size x tp_size`` grid.
        """
        par = self._vllm_config.parallel_config
        want = {
            (pp, tp)
            for pp in range(par.pipeline_parallel_size)
            for tp in range(par.tensor_parallel_size)
        }
        if metadata and set(metadata) != want:
            raise ValueError(
                f"PdplugConnector: handshake from ranks {sorted(metadata)}, expected every "
                f"(pp_rank, tp_rank) of pp_size={par.pipeline_parallel_size} x "
                f"tp_size={par.tensor_parallel_size}"
            )
        self.handshake_ranks = tuple(sorted(metadata))

    def shutdown(self) -> None:
        """Stop the rendezvous server (prefill scheduler) or close the worker's pdplug
        session (aborting what is left); idempotent."""
        if self.worker is not None:
            self.worker.close()
            return
        if self.rendezvous is not None:
            self.rendezvous.stop()
            self.rendezvous = None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register vLLM's per-layer KV tensors with the pdplug session (see
        :meth:`pdplug.adapters.vllm.worker.PushWorker.register`)."""
        assert self.worker is not None
        self.worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker: this rank's :class:`PdplugHandshakeMetadata` (None on the scheduler)."""
        if self.worker is None:
            return None
        w = self.worker.where
        return PdplugHandshakeMetadata(
            instance=w.instance, side=w.side, pp_rank=w.pp_rank, tp_rank=w.tp_rank
        )

    def _apply_plan(self) -> None:
        # once per step, whichever hook comes first (no-forward steps run them too)
        if self.worker is None or not self.has_connector_metadata():
            return
        # a flag on the step's own object: id() of a freed object is reused by the next one,
        # which silently dropped a whole step's plan
        meta = self._get_connector_metadata()
        if isinstance(meta, PdplugConnectorMetadata) and not meta.applied:
            meta.applied = True
            self.worker.on_plan(meta.plan)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Abort the step's aborted/preempted rooms and wait (bounded by
        ``transfer_timeout_s``) until no write reads or lands in their blocks."""
        if self.worker is not None and isinstance(kv_connector_metadata, PdplugConnectorMetadata):
            self.worker.preempt(kv_connector_metadata.plan, wait=True)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Apply this step's plan once (aborts, receive jobs, cancels; send jobs queued)."""
        self._apply_plan()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a decode request runs only once its room succeeded."""
        return  # loads are asynchronous: a request runs only after its room succeeded

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: a step's sends are posted in :meth:`wait_for_save`."""
        return  # sends are posted per step in wait_for_save

    def wait_for_save(self) -> None:
        """Post this step's send jobs. On CPU the forward wrote their KV already; on a GPU
        they carry a CUDA event recorded after the forward's KV writes
        (:func:`pdplug.adapters.push.step_ready`): the sender reads the blocks once it
        completed, the step never waits on the stream."""
        self._apply_plan()
        w = self.worker
        if w is None or w.session is None or not w.has_pending():
            return
        w.post(ready=step_ready(str(w.session.config.device)))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)`` of :meth:`get_transfer_results`."""
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Rooms that ended and drained: ``finished_sending`` (prefill, blocks may be freed),
        ``finished_recving`` (decode) and ``failed_recving`` (decode; vLLM applies
        ``kv_load_failure_policy``)."""
        if self.worker is None:
            return KVConnectorTransferResults()
        self._apply_plan()
        r = self.worker.results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Bytes posted and rooms ended on this worker since the last call (None: nothing)."""
        if self.worker is None:
            return None
        stats = PdplugKVConnectorStats(data=self.worker.stats_delta())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """:class:`~pdplug.adapters.vllm.stats.PdplugKVConnectorStats` from ``data``."""
        return PdplugKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """:class:`~pdplug.adapters.vllm.stats.PdplugPromMetrics` (the pdplug counters)."""
        return PdplugPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Always empty: a failed room fails its whole request through ``failed_recving``
        (which also works with several KV cache groups)."""
        return set()
