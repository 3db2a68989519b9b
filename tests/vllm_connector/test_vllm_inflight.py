"""PdplugConnector's decode side in vLLM's real Scheduler with two steps in flight.

With async scheduling (vLLM 0.33's default on GPU engines) or PP, vLLM schedules step N+1
before step N's output came back (``max_concurrent_batches`` 2). On a decode engine
(``kv_consumer``) it then defers freeing a finished request's blocks until every step that may
still write them was processed (vLLM 0.32 and 0.33). vLLM 0.33 can also defer an async load:
with HiSparse, ``schedule()`` allocates the blocks but calls ``update_state_after_alloc`` only
from ``update_from_output`` of the step that was in flight (``Scheduler._drain_deferred_loads``),
so the room's receive job goes out one step later and a request can be aborted in between.

HiSparse itself needs several KV cache groups, which PdplugConnector refuses; the tests set
``KVCacheConfig.hisparse_host_num_blocks`` on a one-group cache, which is the only condition
vLLM checks (``Scheduler.defer_async_loads``), to drive that timing through the real code.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from _sched import InFlight, assert_scheduler_empty, make_request, make_scheduler
from vllm.v1.request import RequestStatus

from pdplug.adapters.version import minor_version
from pdplug.adapters.vllm import installed_vllm
from pdplug.adapters.vllm.params import decode_request_params

pytestmark = pytest.mark.vllm

BOOT = "tcp://127.0.0.1:40001"
_found = installed_vllm()
_release = (minor_version(_found[1]) if _found else None) or (0, 0)
needs_deferred_loads = pytest.mark.skipif(
    _release < (0, 33), reason="vLLM < 0.33 starts every async load in schedule()"
)


def prompt(n: int, base: int = 3) -> list[int]:
    return [base + i % 500 for i in range(n)]


def decode_scheduler(tiny_model: str, *, deferred_loads: bool):
    fields = {"hisparse_host_num_blocks": 64} if deferred_loads else None
    s = make_scheduler(
        tiny_model, "decode", batched_tokens=512, async_scheduling=True, kv_cache_fields=fields
    )
    assert s.vllm_config.max_concurrent_batches == 2 and s.defer_block_free
    assert getattr(s, "defer_async_loads", False) is deferred_loads
    return s


def blocks_of(s, rid: str) -> tuple[int, ...]:
    mgr = s.kv_cache_manager.coordinator.single_type_managers[0]
    return tuple(b.block_id for b in mgr.req_to_blocks[rid])


def drain(run: InFlight, *, until: set[str], **reports) -> dict:
    """Keep two steps in flight until every request in ``until`` finished, then end the steps
    still in flight; ``reports`` go with the first step that ends."""
    done: dict = {}
    for _ in range(20):
        if until <= set(done):
            break
        if run.s.has_requests():
            run.schedule()
        if run.queue:
            done.update(run.finish(**reports))
            reports = {}
    while run.queue:
        done.update(run.finish(**reports))
        reports = {}
    assert until <= set(done), f"not finished: {until - set(done)}"
    return done


def test_decode_two_steps_in_flight_receives_then_decodes(tiny_model):
    # vLLM 0.32 and 0.33: the load starts in schedule(); frees wait for the in-flight step
    s = decode_scheduler(tiny_model, deferred_loads=False)
    a = make_request("a", prompt(64), None, max_tokens=6)
    d = make_request("d", prompt(100, base=50), decode_request_params(41, "prefill-0", BOOT), 3)
    run = InFlight(s, [a, d])
    s.add_request(a)
    assert not run.schedule()
    s.add_request(d)
    (job,) = run.schedule().recv  # in the step that allocated, with one step in flight
    assert (job.room, job.decode_prefix_len, job.num_prompt_tokens) == (41, 0, 100)
    assert job.block_ids == blocks_of(s, "d") and d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    run.finish()
    done = drain(run, until={"a", "d"}, finished_recving={"d"})
    assert d.num_output_tokens == 3 and done["d"].finish_reason is not None
    assert_scheduler_empty(s)


@needs_deferred_loads
def test_decode_deferred_load_registers_destination_after_the_fence(tiny_model):
    s = decode_scheduler(tiny_model, deferred_loads=True)
    a = make_request("a", prompt(64), None, max_tokens=6)
    d = make_request("d", prompt(100, base=50), decode_request_params(42, "prefill-0", BOOT), 3)
    run = InFlight(s, [a, d])
    s.add_request(a)
    run.schedule()
    s.add_request(d)
    plan = run.schedule()
    # blocks allocated, request parked, but vLLM has not told the connector yet
    assert not plan.recv and d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "d" in s.deferred_loads and len(blocks_of(s, "d")) == 4
    assert s.connector.has_pending_push_work() is False
    run.finish()  # the step in flight ended: vLLM calls update_state_after_alloc now
    assert "d" not in s.deferred_loads and s.connector.has_pending_push_work()
    (job,) = run.schedule().recv
    assert (job.room, job.decode_prefix_len, job.num_prompt_tokens) == (42, 0, 100)
    assert job.block_ids == blocks_of(s, "d")
    run.finish()
    done = drain(run, until={"a", "d"}, finished_recving={"d"})
    assert d.num_output_tokens == 3 and done["d"].finish_reason is not None
    assert_scheduler_empty(s)


@needs_deferred_loads
def test_decode_aborted_before_its_deferred_load_cancels_and_frees(tiny_model):
    s = decode_scheduler(tiny_model, deferred_loads=True)
    a = make_request("a", prompt(64), None, max_tokens=4)
    d = make_request("d", prompt(100, base=50), decode_request_params(43, "prefill-0", BOOT), 3)
    run = InFlight(s, [a, d])
    s.add_request(a)
    run.schedule()
    s.add_request(d)
    run.schedule()
    assert "d" in s.deferred_loads
    # aborted before vLLM told the connector: no worker ever registers the room, so vLLM
    # must not wait for its finished_recving, and the prefill side is told to stop
    s.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert "d" not in s.requests and "d" not in s.deferred_loads
    run.finish()
    plan = run.schedule()
    assert not plan.recv and not plan.abort
    (c,) = plan.cancel
    assert (c.room, c.prefill_instance, c.bootstrap) == (43, "prefill-0", BOOT)
    run.finish()
    drain(run, until={"a"})
    assert_scheduler_empty(s)


@needs_deferred_loads
def test_decode_aborted_between_deferred_load_and_plan_holds_blocks(tiny_model):
    s = decode_scheduler(tiny_model, deferred_loads=True)
    a = make_request("a", prompt(64), None, max_tokens=4)
    d = make_request("d", prompt(100, base=50), decode_request_params(44, "prefill-0", BOOT), 3)
    run = InFlight(s, [a, d])
    s.add_request(a)
    run.schedule()
    s.add_request(d)
    run.schedule()
    run.finish()  # update_state_after_alloc: the receive job waits for the next plan
    s.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert "d" in s.requests  # vLLM holds the blocks until the workers report the room
    plan = run.schedule()
    # the same plan registers the room and aborts it (the worker applies recv first), so
    # the workers report it once drained and no prefill write lands in reused blocks
    assert [j.room for j in plan.recv] == [44] and plan.abort == (("d", 44),)
    run.finish()
    drain(run, until={"a"})
    assert "d" in s.requests
    run.schedule()
    run.finish(finished_recving={"d"})
    drain(run, until=set())
    assert_scheduler_empty(s)
