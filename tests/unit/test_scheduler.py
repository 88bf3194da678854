"""The scheduler alone, on a real block manager and no model: which tokens of which
requests each step computes under the token budget (chunked prefill, decodes first),
what preemption frees and requeues, what the prefix cache saves, what priority takes;
exact token counts and block ids. A step is "computed" here by advancing the requests
as the engine does after its forward pass (every sampling request gets token 7)."""

from __future__ import annotations

from common.config import SchedulerConfig
from common.protocol import SamplingParams
from engine_worker.block_manager import BlockManager
from engine_worker.request import Request, RequestStatus
from engine_worker.scheduler import Scheduler, SchedulerOutput


def scheduler(num_blocks: int, budget: int, batch: int = 4) -> Scheduler:
    config = SchedulerConfig(max_batch_size=batch,
                             max_num_batched_tokens=budget).for_device("cpu")
    return Scheduler(config, BlockManager(num_blocks, block_size=4, enable_prefix_caching=True))


def request(request_id: str, prompt: list[int], max_tokens: int, priority: int = 0) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, priority=priority),
                   max_tokens, frozenset())


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[tuple[str, int]]]:
    """One step: scheduled, then advanced; (request id, tokens computed) in order."""
    out = sched.schedule()
    for s in out.scheduled:
        r = s.request
        samples = s.samples
        r.num_computed_tokens += s.num_tokens
        if samples:
            r.append_token(7)
            if r.num_output_tokens >= r.max_tokens:
                sched.finish(r)
    return out, [(s.request.request_id, s.num_tokens) for s in out.scheduled]


def test_prompts_are_chunked_under_the_budget_and_decodes_go_first():
    sched = scheduler(num_blocks=16, budget=8)
    a, b, c = (request("a", list(range(5)), 2), request("b", list(range(100, 112)), 2),
               request("c", list(range(200, 203)), 2))
    for r in (a, b, c):
        sched.add(r)
    # a's prompt whole, b's first 3 tokens: the budget is spent, c waits
    assert step(sched)[1] == [("a", 5), ("b", 3)]
    assert (a.blocks.block_ids, b.blocks.block_ids) == ([0, 1], [2])
    assert c.status is RequestStatus.WAITING
    # a decodes first, b's chunk takes the rest of the budget
    assert step(sched)[1] == [("a", 1), ("b", 7)]
    assert b.blocks.block_ids == [2, 3, 4]
    # a ended on its second token (its partial block freed, its full one cached); b's
    # last 2 prompt tokens, then c admitted
    assert a.status is RequestStatus.FINISHED and a.blocks.block_ids == []
    assert step(sched)[1] == [("b", 2), ("c", 3)]
    assert c.blocks.block_ids == [5]   # a block never used yet comes first
    assert step(sched)[1] == [("b", 1), ("c", 1)]
    assert not sched.running and not sched.waiting
    bm = sched.block_manager
    assert (bm.num_used_blocks, bm.num_free_blocks) == (0, 16)


def test_a_short_pool_preempts_the_newest_request_and_recomputes_it_from_the_cache():
    sched = scheduler(num_blocks=4, budget=16)
    x, y = request("x", list(range(10, 16)), 6), request("y", list(range(20, 26)), 6)
    sched.add(x)
    sched.add(y)
    assert step(sched)[1] == [("x", 6), ("y", 6)]
    assert (x.blocks.block_ids, y.blocks.block_ids) == ([0, 1], [2, 3])
    for _ in range(2):   # each fills its two blocks (both now in the prefix cache)
        assert step(sched)[1] == [("x", 1), ("y", 1)]
    # x's ninth token needs a third block: y, admitted after it, is preempted; its
    # blocks stay cached, its tail evicted first: to x
    out, computed = step(sched)
    assert computed == [("x", 1)] and out.preempted == [y]
    assert (y.status, y.num_computed_tokens, y.num_preemptions) == (RequestStatus.WAITING, 0, 1)
    assert x.blocks.block_ids == [0, 1, 3]
    # y needs three blocks (its cached one revived, and two) where one is left: it waits
    for _ in range(2):
        assert step(sched)[1] == [("x", 1)]
    assert x.status is RequestStatus.FINISHED
    # x done: y computes only what its cached block does not hold, 5 of its 9 tokens
    assert step(sched)[1] == [("y", 5)]
    assert y.blocks.block_ids[0] == 2
    while sched.running:
        step(sched)
    assert y.num_output_tokens == 6 and sched.num_preemptions == 1
    assert sched.block_manager.num_used_blocks == 0


def test_a_shared_prefix_is_computed_once():
    sched = scheduler(num_blocks=16, budget=64)
    shared = list(range(300, 312))   # 3 full blocks
    first = request("first", shared + [1], 1)
    sched.add(first)
    assert step(sched)[1] == [("first", 13)]
    second = request("second", shared + [2, 3], 2)
    sched.add(second)
    assert step(sched)[1] == [("second", 2)]   # 12 of its 14 tokens were cached
    assert second.num_cached_tokens == 12 and second.blocks.block_ids[:3] == [0, 1, 2]
    assert (sched.prefix_cache_query_tokens, sched.prefix_cache_hit_tokens) == (27, 12)


def test_a_waiting_request_of_a_lower_priority_value_takes_a_running_ones_place():
    sched = scheduler(num_blocks=16, budget=16, batch=2)
    low, mid = request("low", list(range(4)), 8, priority=5), request("mid", [9] * 4, 8,
                                                                          priority=3)
    sched.add(low)
    sched.add(mid)
    assert step(sched)[1] == [("mid", 4), ("low", 4)]   # by priority
    urgent = request("urgent", [5] * 4, 8, priority=0)
    sched.add(urgent)
    out, computed = step(sched)
    # the running set is full (2): the highest value, 5, gives up its place
    assert out.preempted == [low] and low.status is RequestStatus.WAITING
    assert computed == [("mid", 1), ("urgent", 4)]
