"""The adapters' push segmentation with the selected (default) pdplug scheduler, on the jobs
the vLLM adapter issues: every prompt token beyond the decode prefix is sent exactly once, in
order, within the cut bound, with the right source blocks, whatever the chunking of the
prefill."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplug import SchedulerConfig
from pdplug.adapters.push import PushCursor, SendJob, segments_for_job


def jobs_for(prompt: int, chunks: list[int], block: int, room: int = 9) -> list[SendJob]:
    """The SendJobs PushBook issues for a prefill computed in ``chunks`` (tokens per step)."""
    out, done, blocks = [], 0, []
    for c in chunks:
        end = min(done + c, prompt)
        blocks = list(range(100, 100 + -(-end // block)))
        out.append(
            SendJob(req_id="r", room=room, page_ids=tuple(blocks), token_start=done,
                    token_end=end, num_prompt_tokens=prompt, is_last=end == prompt)
        )  # fmt: skip
        done = end
        if end == prompt:
            break
    return out


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    block=st.sampled_from([16, 32]),
    prompt=st.integers(1, 700),
    chunk=st.integers(1, 300),
    prefix_blocks=st.integers(0, 30),
    cap_pages=st.one_of(st.none(), st.integers(1, 8)),
    grid_pages=st.integers(1, 8),
)
def test_every_token_once_in_order_within_bound(  # the manager is only read here
    plugin_manager, block, prompt, chunk, prefix_blocks, cap_pages, grid_pages
):
    dpl = min(prefix_blocks * block, (prompt - 1) // block * block)
    sched = plugin_manager.make_scheduler(
        SchedulerConfig(page_size=block, chunk_size=grid_pages * block)
    )
    cap = None if cap_pages is None else cap_pages * block
    cur = PushCursor(room=9)
    segs = []
    for job in jobs_for(prompt, [chunk] * (prompt // chunk + 2), block):
        segs += segments_for_job(cur, job, decode_prefix_len=dpl, capacity_tokens=cap,
                                 block_size=block, scheduler=sched)  # fmt: skip
    assert cur.done and segs[-1][0].is_last and not any(s.is_last for s, _ in segs[:-1])
    assert [s.chunk_id for s, _ in segs] == list(range(len(segs)))
    bounds = [(s.token_start, s.token_end) for s, _ in segs]
    assert bounds[0][0] == dpl and bounds[-1][1] == prompt
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))  # contiguous, no overlap
    bound = grid_pages * block if cap is None else min(grid_pages * block, cap)
    for s, pages in segs:
        assert s.num_tokens == s.token_end - s.token_start
        if cap is not None:
            assert s.num_tokens <= bound
        if not s.is_last:
            assert s.token_end % block == 0 and s.num_tokens > 0
        want = np.arange(s.token_start // block, -(-s.token_end // block)) + 100
        assert pages.dtype == np.int64 and pages.tolist() == want.tolist()


def test_job_below_the_decode_prefix_sends_nothing_then_last_is_metadata_only(plugin_manager):
    sched = plugin_manager.make_scheduler(SchedulerConfig(page_size=32, chunk_size=64))
    cur = PushCursor(room=9)
    a, b = jobs_for(96, [64, 64], 32)
    assert segments_for_job(cur, a, decode_prefix_len=64, capacity_tokens=None,
                            block_size=32, scheduler=sched) == []  # fmt: skip
    ((seg, pages),) = segments_for_job(cur, b, decode_prefix_len=64, capacity_tokens=None,
                                       block_size=32, scheduler=sched)  # fmt: skip
    assert (seg.token_start, seg.token_end, seg.is_last, pages.tolist()) == (64, 96, True, [102])


def test_misuse_is_named(plugin_manager):
    sched = plugin_manager.make_scheduler(SchedulerConfig(page_size=32))
    (job,) = jobs_for(64, [64], 32)
    kw = {"capacity_tokens": None, "block_size": 32, "scheduler": sched}
    with pytest.raises(ValueError, match="decode_prefix_len=40"):
        segments_for_job(PushCursor(room=9), job, decode_prefix_len=40, **kw)
    with pytest.raises(ValueError, match="job room 9 != cursor room 8"):
        segments_for_job(PushCursor(room=8), job, decode_prefix_len=0, **kw)
    cur = PushCursor(room=9)
    segments_for_job(cur, job, decode_prefix_len=0, **kw)
    with pytest.raises(ValueError, match="already sent its last segment"):
        segments_for_job(cur, job, decode_prefix_len=0, **kw)


def test_a_chunk_of_pages_from_first_page_sends_what_the_whole_list_sends(plugin_manager):
    """An engine that hands over one chunk's pages per send (SGLang's ``kv_indices``) gets the
    same segments and source pages as one that hands over every page so far (vLLM)."""
    sched = plugin_manager.make_scheduler(SchedulerConfig(page_size=32, chunk_size=64))
    whole, chunked = PushCursor(room=9), PushCursor(room=9)
    kw = {"decode_prefix_len": 32, "capacity_tokens": None, "block_size": 32, "scheduler": sched}
    for job in jobs_for(300, [128, 128, 128], 32):
        first = job.token_start // 32
        part = msgspec.structs.replace(job, page_ids=job.page_ids[first:], first_page=first)
        a = segments_for_job(whole, job, **kw)
        b = segments_for_job(chunked, part, **kw)
        assert [(s, p.tolist()) for s, p in a] == [(s, p.tolist()) for s, p in b]
    assert whole.done and chunked.done


def test_whole_pages_round_the_last_segment_up_to_a_page(plugin_manager):
    sched = plugin_manager.make_scheduler(SchedulerConfig(page_size=32, chunk_size=64))
    kw = {"decode_prefix_len": 0, "capacity_tokens": None, "block_size": 32, "scheduler": sched}
    (job,) = jobs_for(70, [70], 32)
    plain = segments_for_job(PushCursor(room=9), job, **kw)
    whole = segments_for_job(PushCursor(room=9), job, whole_pages=True, **kw)
    assert plain[-1][0].token_end == 70 and whole[-1][0].token_end == 96
    assert whole[-1][1].tolist() == [100, 101, 102]  # the partial page too, moved whole


def test_pages_that_do_not_hold_a_segment_are_named(plugin_manager):
    sched = plugin_manager.make_scheduler(SchedulerConfig(page_size=32, chunk_size=64))
    kw = {"decode_prefix_len": 0, "capacity_tokens": None, "block_size": 32, "scheduler": sched}
    (job,) = jobs_for(96, [96], 32)
    short = msgspec.structs.replace(job, page_ids=job.page_ids[:2])
    with pytest.raises(ValueError, match=r"need pages \[0, 3\), the job holds pages \[0, 2\)"):
        segments_for_job(PushCursor(room=9), short, **kw)
    late = msgspec.structs.replace(job, page_ids=job.page_ids[1:], first_page=1)
    with pytest.raises(ValueError, match=r"need pages \[0, 3\), the job holds pages \[1, 3\)"):
        segments_for_job(PushCursor(room=9), late, **kw)
