"""The scheduler's queues of requests that are not running (waiting, swapped), in the order of its policy.

vLLM's two scheduling policies:
- "fcfs": arrival order; a preempted request goes back in front of the queue.
- "priority": the lowest `priority` value first, then the earliest arrival (then the request id, so
  that ties have one order); a preempted request goes back to its place in that order.

Both queues have one interface, so the scheduler reads the same under either policy.
"""

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from jaxpaged.core.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(request: Request) -> tuple[int, float]:
    """What "priority" orders by: the lower, the sooner (the running list too, so that preemption takes
    the request with the highest key)."""
    return request.priority, request.arrival_time


class FCFSQueue:
    """Arrival order; `prepend` puts a request back in front."""

    def __init__(self):
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_all(self, requests: list[Request]) -> None:
        """Put `requests` back in front, in their order."""
        self._queue.extendleft(reversed(requests))

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """A heap on (priority, arrival time, request id); a request put back goes to its place."""

    def __init__(self):
        self._heap: list[tuple[int, float, str, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), request.request_id, request))

    prepend = add

    def prepend_all(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add(request)

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        """O(n): aborts are rare next to the heap's pushes and pops."""
        kept = [entry for entry in self._heap if entry[-1] is not request]
        if len(kept) == len(self._heap):
            raise ValueError(f"{request.request_id!r} is not in the queue")
        heapq.heapify(kept)
        self._heap = kept

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In the order the queue pops them."""
        return (entry[-1] for entry in sorted(self._heap, key=lambda entry: entry[:3]))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
