"""The waiting queue, one class per scheduling policy; the Scheduler picks one once, from its config."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from scheduler.request import Request


class FcfsQueue:
    """Waiting requests in the order they run under the fcfs policy: arrival order.

    Invariants: ``queue`` holds exactly the requests of ``members`` (by id), each
    once. A request put back (``requeue``: preempted, or an n > 1 sibling released
    once child 0 computed the prompt) goes in front: it arrived before everything
    still waiting, so arrival order puts it there. The running request preempted
    first is the one admitted last (the tail of the running list).
    """

    __slots__ = ("queue", "members")

    def __init__(self) -> None:
        self.queue: deque[Request] = deque()
        self.members: dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, request: Request) -> bool:
        return self.members.get(request.request_id) is request

    def add(self, request: Request) -> None:
        self.members[request.request_id] = request
        self.queue.append(request)

    def requeue(self, request: Request) -> None:
        self.members[request.request_id] = request
        self.queue.appendleft(request)

    def peek(self) -> Request | None:
        return self.queue[0] if self.queue else None

    def pop(self) -> Request:
        request = self.queue.popleft()
        del self.members[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        del self.members[request.request_id]
        self.queue.remove(request)

    @staticmethod
    def order_key(request: Request) -> float:
        """Which of several requests (the swapped ones) resumes first: the smallest key."""
        return request.arrival_time

    @staticmethod
    def pick_victim(running: list[Request]) -> Request:
        return running[-1]


class PriorityQueue:
    """Waiting requests in the order they run under the priority policy: lower ``priority`` first, ties by arrival.

    Invariants: ``heap`` holds an entry (priority, arrival_time, tie-breaker,
    request) for every request of ``members``, in heap order; an entry whose
    request is no longer the member of its id is stale (``remove`` is lazy: a
    heap cannot delete from its middle) and is dropped when it reaches the top.
    A request put back (``requeue``: preempted, or a released n > 1 sibling) goes
    where its own key orders it, like any other. The running request preempted
    first is the one this order would run last.
    """

    __slots__ = ("heap", "members", "counter")

    def __init__(self) -> None:
        self.heap: list[tuple[int, float, int, Request]] = []
        self.members: dict[str, Request] = {}
        self.counter = itertools.count()  # equal keys never compare the Requests

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, request: Request) -> bool:
        return self.members.get(request.request_id) is request

    def add(self, request: Request) -> None:
        self.members[request.request_id] = request
        heapq.heappush(self.heap, (request.priority, request.arrival_time, next(self.counter), request))

    def requeue(self, request: Request) -> None:
        self.add(request)  # its own (priority, arrival) key places it

    def peek(self) -> Request | None:
        heap, members = self.heap, self.members
        while heap and members.get(heap[0][3].request_id) is not heap[0][3]:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def pop(self) -> Request:
        request = self.peek()
        heapq.heappop(self.heap)
        del self.members[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        del self.members[request.request_id]

    @staticmethod
    def order_key(request: Request) -> tuple[int, float]:
        """Which of several requests (the swapped ones) resumes first: the smallest key."""
        return request.priority, request.arrival_time

    @staticmethod
    def pick_victim(running: list[Request]) -> Request:
        return max(running, key=PriorityQueue.order_key)


WAITING_QUEUES = {"fcfs": FcfsQueue, "priority": PriorityQueue}
