"""PdplugConnector's scheduler side inside vLLM's real Scheduler (vLLM 0.32).

Each test runs requests through ``schedule()`` / ``update_from_output()`` with the reports
the workers would send, checks the plan the workers get each step, and ends with the no-leak
check (no request, no held block, no connector state).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from _sched import (
    BLOCK,
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    plan_of,
    runner_output,
)
from vllm.v1.request import RequestStatus

from pdplug.adapters.vllm.params import (
    decode_request_params,
    prefill_request_params,
)

pytestmark = pytest.mark.vllm

BOOT = "tcp://127.0.0.1:40001"


def prompt(n: int, base: int = 3) -> list[int]:
    return [base + i % 500 for i in range(n)]


def step(s, reqs, **reports):
    so = s.schedule()
    scheduled = [r for r in reqs if r.request_id in so.num_scheduled_tokens]
    outs = s.update_from_output(so, runner_output(scheduled, **reports))
    done = {o.request_id: o for v in outs.values() for o in v.outputs if o.finish_reason}
    step.last = so
    return plan_of(so), done


# ------------------------------------------------------------------------------ prefill


def test_prefill_chunks_become_send_jobs_and_blocks_stay_held(tiny_model):
    s = make_scheduler(tiny_model, "prefill", batched_tokens=128)
    r = make_request("p1", prompt(300), prefill_request_params(11, "decode-0"))
    s.add_request(r)
    jobs = []
    for _ in range(3):
        plan, done = step(s, [r])
        jobs += plan.send
    assert [(j.token_start, j.token_end, j.is_last) for j in jobs] == [
        (0, 128, False), (128, 256, False), (256, 300, True)
    ]  # fmt: skip
    assert [len(j.page_ids) for j in jobs] == [4, 8, 10]
    assert jobs[-1].page_ids[:8] == jobs[1].page_ids  # token order, append-only
    assert done["p1"].kv_transfer_params == {"pdplug": {"room": 11, "sent_tokens": 300}}
    # finished, but its blocks are held until the workers report the room drained
    blocks = s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["p1"]
    assert len(blocks) == 10 and all(b.ref_cnt == 1 for b in blocks)
    for _ in range(3):
        plan, _ = step(s, [])
        assert not plan
    assert "p1" in s.requests and s.connector.has_pending_push_work()
    step(s, [], finished_sending={"p1"})
    assert_scheduler_empty(s)


def test_prefill_first_job_covers_its_own_prefix_cache_hit(tiny_model):
    s = make_scheduler(tiny_model, "prefill", batched_tokens=512)
    warm = make_request("warm", prompt(256), None)
    s.add_request(warm)
    step(s, [warm])
    step(s, [])
    r = make_request("p2", prompt(256) + prompt(44, base=700), prefill_request_params(12))
    s.add_request(r)
    plan, _ = step(s, [r])
    (job,) = plan.send
    # 256 tokens came from the local prefix cache (8 full blocks), yet the job starts at 0:
    # the decode side needs every block
    (new,) = step.last.scheduled_new_reqs
    assert new.num_computed_tokens == 8 * BLOCK
    assert (job.token_start, job.token_end, job.is_last, len(job.page_ids)) == (0, 300, True, 10)
    step(s, [], finished_sending={"p2"})
    assert_scheduler_empty(s)


def test_prefill_abort_mid_prefill_aborts_room_and_holds_until_drained(tiny_model):
    s = make_scheduler(tiny_model, "prefill", batched_tokens=128)
    r = make_request("p3", prompt(300), prefill_request_params(13))
    s.add_request(r)
    plan, _ = step(s, [r])
    assert len(plan.send) == 1
    s.finish_requests(["p3"], RequestStatus.FINISHED_ABORTED)
    plan, _ = step(s, [])
    assert plan.abort == (("p3", 13),) and not plan.send
    assert "p3" in s.requests  # blocks held: a posted write may still read them
    step(s, [], finished_sending={"p3"})
    assert_scheduler_empty(s)


def test_prefill_abort_before_any_chunk_frees_at_once(tiny_model):
    s = make_scheduler(tiny_model, "prefill")
    r = make_request("p4", prompt(64), prefill_request_params(14))
    s.add_request(r)
    s.finish_requests(["p4"], RequestStatus.FINISHED_ABORTED)
    plan, _ = step(s, [])
    assert not plan
    assert_scheduler_empty(s)


def test_prefill_refuses_a_second_request_with_a_live_room(tiny_model):
    s = make_scheduler(tiny_model, "prefill", batched_tokens=512)
    a = make_request("a", prompt(64), prefill_request_params(15))
    b = make_request("b", prompt(64, base=9), prefill_request_params(15))
    s.add_request(a)
    s.add_request(b)
    plan, done = step(s, [a, b])
    assert [j.req_id for j in plan.send] == ["a"]
    assert done["b"].kv_transfer_params == {
        "pdplug": {"error": "room 15 is live for request a on this engine"}
    }
    step(s, [], finished_sending={"a"})
    assert_scheduler_empty(s)


def test_prefill_malformed_params_are_named_and_not_sent(tiny_model):
    s = make_scheduler(tiny_model, "prefill")
    r = make_request("p5", prompt(40), {"do_remote_decode": True, "pdplug": {"room": -3}})
    s.add_request(r)
    plan, done = step(s, [r])
    assert not plan.send
    assert "room=-3" in done["p5"].kv_transfer_params["pdplug"]["error"]
    step(s, [])
    assert_scheduler_empty(s)


def test_prefill_preempted_room_is_aborted_and_not_resent(tiny_model):
    # 5 usable blocks: two 64-token prompts take 2 each; their first generated tokens need a
    # third block each, so vLLM preempts one of them (max_tokens > 1 only to get there)
    s = make_scheduler(tiny_model, "prefill", num_blocks=6, batched_tokens=256)
    a = make_request("a", prompt(64), prefill_request_params(21), max_tokens=4)
    b = make_request("b", prompt(64, base=600), prefill_request_params(22), max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    plan, _ = step(s, [a, b])
    assert sorted((j.req_id, j.is_last) for j in plan.send) == [("a", True), ("b", True)]
    plan, _ = step(s, [a, b])
    (victim,) = step.last.preempted_req_ids
    room = {"a": 21, "b": 22}[victim]
    assert plan.abort == ((victim, room),)  # in the step that frees its blocks
    done: dict = {}
    drained: set[str] = set()
    for _ in range(20):  # the other one finishes; its drained room frees the victim's way
        report = set(done) - {victim} - drained
        drained |= report
        plan, d = step(s, [a, b], finished_sending=report or None)
        done.update(d)
        assert not any(j.req_id == victim for j in plan.send)  # resumed: nothing resent
        if victim in done:
            break
    assert done[victim].kv_transfer_params == {"pdplug": {"room": room, "error": "aborted"}}
    step(s, [], finished_sending={victim})
    assert_scheduler_empty(s)


# ------------------------------------------------------------------------------ decode


def decode_params(room: int) -> dict:
    return decode_request_params(room, "prefill-0", BOOT)


def test_decode_registers_destination_blocks_then_decodes(tiny_model):
    s = make_scheduler(tiny_model, "decode")
    r = make_request("d1", prompt(300), decode_params(31), max_tokens=4)
    s.add_request(r)
    plan, _ = step(s, [r])
    (job,) = plan.recv
    assert (job.room, job.decode_prefix_len, job.num_prompt_tokens) == (31, 0, 300)
    assert len(job.block_ids) == 10 and job.prefill_instance == "prefill-0"
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    plan, _ = step(s, [r])  # still waiting: nothing more to do
    assert not plan and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, [r], finished_recving={"d1"})
    done = {}
    for _ in range(8):
        _, d = step(s, [r])
        done.update(d)
        if done:
            break
    assert done["d1"].finish_reason is not None and r.num_output_tokens == 4
    assert_scheduler_empty(s)


def test_decode_local_prefix_hit_sets_decode_prefix_len(tiny_model):
    s = make_scheduler(tiny_model, "decode", batched_tokens=512)
    warm = make_request("warm", prompt(256), None)
    s.add_request(warm)
    step(s, [warm])
    step(s, [])
    r = make_request("d2", prompt(256) + prompt(44, base=700), decode_params(32), max_tokens=1)
    s.add_request(r)
    plan, _ = step(s, [r])
    (job,) = plan.recv
    assert job.decode_prefix_len == 8 * BLOCK  # the full blocks of the local hit
    assert len(job.block_ids) == 10 - 8
    step(s, [r], finished_recving={"d2"})
    for _ in range(4):
        step(s, [r])
    assert_scheduler_empty(s)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_decode_failed_transfer_follows_kv_load_failure_policy(tiny_model, policy):
    s = make_scheduler(tiny_model, "decode", policy=policy, batched_tokens=512)
    r = make_request("d3", prompt(100), decode_params(33), max_tokens=2)
    s.add_request(r)
    step(s, [r])
    _, done = step(s, [r], finished_recving={"d3"}, failed_recving={"d3"})
    if policy == "fail":
        assert done["d3"].finish_reason is not None
        assert r.status == RequestStatus.FINISHED_ERROR
    else:  # recomputed locally from token 0, then decoded
        for _ in range(6):
            _, d = step(s, [r])
            done.update(d)
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_output_tokens == 2
    assert_scheduler_empty(s)


def test_decode_abort_while_waiting_aborts_room_and_vllm_holds_blocks(tiny_model):
    s = make_scheduler(tiny_model, "decode")
    r = make_request("d4", prompt(100), decode_params(34), max_tokens=2)
    s.add_request(r)
    step(s, [r])
    s.finish_requests(["d4"], RequestStatus.FINISHED_ABORTED)
    plan, _ = step(s, [])
    assert plan.abort == (("d4", 34),)
    assert "d4" in s.requests  # a prefill write may still land in its blocks
    step(s, [], finished_recving={"d4"})  # the workers saw the room drain
    assert_scheduler_empty(s)


def test_decode_abort_before_scheduling_cancels_the_prefill_room(tiny_model):
    s = make_scheduler(tiny_model, "decode")
    r = make_request("d5", prompt(100), decode_params(35))
    s.add_request(r)
    s.finish_requests(["d5"], RequestStatus.FINISHED_ABORTED)
    plan, _ = step(s, [])
    (c,) = plan.cancel
    assert (c.room, c.prefill_instance, c.bootstrap) == (35, "prefill-0", BOOT)
    assert_scheduler_empty(s)


def test_decode_malformed_params_fail_the_request_never_a_silent_prefill(tiny_model):
    s = make_scheduler(tiny_model, "decode")
    bad = {"do_remote_prefill": True, "pdplug": {"room": 36, "bootstrap": "http://x"}}
    r = make_request("d6", prompt(100), bad)
    s.add_request(r)
    plan, _ = step(s, [r])
    (job,) = plan.recv
    assert job.fail and "prefill_instance" in job.fail
    _, done = step(s, [r], finished_recving={"d6"}, failed_recving={"d6"})
    assert r.status == RequestStatus.FINISHED_ERROR and "d6" in done
    assert_scheduler_empty(s)


def test_decode_second_request_with_a_live_room_fails(tiny_model):
    s = make_scheduler(tiny_model, "decode")
    a = make_request("a", prompt(100), decode_params(37))
    b = make_request("b", prompt(100, base=50), decode_params(37))
    s.add_request(a)
    s.add_request(b)
    plan, _ = step(s, [a, b])
    jobs = {j.req_id: j for j in plan.recv}
    assert jobs["a"].room == 37 and not jobs["a"].fail
    assert "room 37 is live for request a" in jobs["b"].fail
    step(s, [a, b], finished_recving={"a", "b"}, failed_recving={"b"})
    for _ in range(4):
        step(s, [a])
    assert b.status == RequestStatus.FINISHED_ERROR
    assert_scheduler_empty(s)
