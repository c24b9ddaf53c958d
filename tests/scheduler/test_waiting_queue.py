"""The waiting queue of each policy: the order requests leave it, where a put-back request goes, and the victim."""

from scheduler import EngineRequest, Request
from scheduler.waiting_queue import FcfsQueue, PriorityQueue


def request(rid: str, priority: int = 0, arrival_time: float = 0.0) -> Request:
    return Request(
        EngineRequest(request_id=rid, prompt_token_ids=[1, 2, 3], priority=priority, arrival_time=arrival_time)
    )


def drain(queue) -> list[str]:
    order = []
    while queue.peek() is not None:
        order.append(queue.pop().request_id)
    return order


def test_fcfs_runs_in_arrival_order_and_puts_a_preempted_request_in_front():
    queue = FcfsQueue()
    a, b, c, preempted = (request(rid, arrival_time=t) for rid, t in (("a", 1), ("b", 2), ("c", 3), ("p", 0)))
    for r in (a, b, c):
        queue.add(r)
    queue.requeue(preempted)
    queue.remove(b)
    assert len(queue) == 3 and preempted in queue and b not in queue
    assert drain(queue) == ["p", "a", "c"] and len(queue) == 0


def test_priority_runs_lowest_value_first_ties_by_arrival_and_a_preempted_request_keeps_its_place():
    queue = PriorityQueue()
    for rid, priority, t in (("late-urgent", 0, 5), ("bulk", 9, 1), ("early-urgent", 0, 2), ("mid", 3, 3)):
        queue.add(request(rid, priority, t))
    preempted = request("preempted-bulk", 9, 0)  # arrived first, but its priority still puts it behind mid
    queue.requeue(preempted)
    assert drain(queue) == ["early-urgent", "late-urgent", "mid", "preempted-bulk", "bulk"]


def test_priority_skips_a_removed_request_and_a_reused_id_is_a_new_entry():
    queue = PriorityQueue()
    first, other = request("r", 0, 1), request("s", 1, 2)
    queue.add(first)
    queue.add(other)
    queue.remove(first)  # aborted while waiting: its heap entry stays until it reaches the top
    assert len(queue) == 1 and first not in queue
    again = request("r", 2, 3)  # a new caller reusing the id: the stale entry must not stand for it
    queue.add(again)
    assert [queue.pop(), queue.pop()] == [other, again] and queue.peek() is None


def test_the_victim_is_the_request_each_policy_would_run_last():
    running = [request("urgent-late", 0, 9), request("bulk-early", 5, 1), request("mid", 2, 5)]
    assert FcfsQueue.pick_victim(running).request_id == "mid"  # admitted last
    assert PriorityQueue.pick_victim(running).request_id == "bulk-early"
    assert min(running, key=FcfsQueue.order_key).request_id == "bulk-early"
    assert min(running, key=PriorityQueue.order_key).request_id == "urgent-late"
