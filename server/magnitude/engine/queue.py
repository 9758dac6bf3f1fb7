"""The waiting queue: priority classes with aging, and tenant fair share within a level.

Effective priority is `priority - age / agingSecondsPerLevel` with age measured from arrival.
Since `now` is the same for every request, ordering by effective priority is ordering by the
static key `priority * agingSecondsPerLevel + arrival`: aging lives in the key, and a heap
stays valid as time passes. Without aging the key is `(priority, arrival)`.

Fairness is hierarchical: the best key decides the *level* (its effective priority rounded up);
among tenants whose best request is at that level, the tenant with the fewest running
sequences per weight, then the least recently served, goes first. One heap per tenant keeps a
pick O(tenants), independent of the queue length. Removal is lazy (a generation number), and a
heap whose dead entries outnumber its live ones (plus COMPACT_SLACK) is rebuilt, so cancelled
requests and their prompt ids do not stay behind a head that never leaves (amortised O(1)).
Pure: no I/O.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from magnitude.engine.request import Request, RequestStatus

QueueKey = tuple[float, float, int]
COMPACT_SLACK = 64  # dead heap entries tolerated beyond the live count before a rebuild


def queue_key(priority: int, arrival: float, seq: int, aging_seconds: float | None) -> QueueKey:
    if aging_seconds is None:
        return (float(priority), arrival, seq)
    return (priority * aging_seconds + arrival, arrival, seq)


def effective_level(priority: int, arrival: float, now: float, aging_seconds: float | None) -> int:
    """The integer priority level a request has reached by `now` (ceil of effective priority)."""
    if aging_seconds is None:
        return priority
    return priority - math.floor(max(0.0, now - arrival) / aging_seconds)


def _live(entry: tuple[QueueKey, Request]) -> bool:
    """An entry is live while its request is still queued under it (not removed, not re-pushed)."""
    key, request = entry
    return request.queue_seq == key[2] and request.status is RequestStatus.WAITING


@dataclass(slots=True)
class _TenantQueue:
    heap: list[tuple[QueueKey, Request]] = field(default_factory=list)
    num_requests: int = 0
    num_tokens: int = 0
    # priority level -> [queued requests, queued tokens]: what admission's fair wait estimate reads
    by_priority: dict[int, list[int]] = field(default_factory=dict)

    def count(self, priority: int, requests: int, tokens: int) -> None:
        figures = self.by_priority.setdefault(priority, [0, 0])
        figures[0] += requests
        figures[1] += tokens
        if figures[0] == 0:
            del self.by_priority[priority]


class RequestQueue:
    """Waiting requests, per tenant, ordered by aged priority."""

    def __init__(self, aging_seconds: float | None, fairness: bool = True):
        self.aging_seconds = aging_seconds
        self.fairness = fairness
        self._tenants: dict[str, _TenantQueue] = {}
        self._seq = itertools.count()
        self.num_requests = 0
        self.num_tokens = 0  # estimated work (prompt + outputs still to compute) of queued requests

    def __len__(self) -> int:
        return self.num_requests

    def key_of(self, request: Request) -> QueueKey:
        return queue_key(request.priority, request.arrival_time, request.queue_seq, self.aging_seconds)

    def level_of(self, request: Request, now: float) -> int:
        return effective_level(request.priority, request.arrival_time, now, self.aging_seconds)

    def push(self, request: Request) -> None:
        request.queue_seq = next(self._seq)
        tq = self._tenants.get(request.tenant)
        if tq is None:
            tq = self._tenants[request.tenant] = _TenantQueue()
        heapq.heappush(tq.heap, (self.key_of(request), request))
        work = request.remaining_work_tokens
        tq.num_requests += 1
        tq.num_tokens += work
        tq.count(request.priority, 1, work)
        self.num_requests += 1
        self.num_tokens += work

    def remove(self, request: Request) -> None:
        """Forget a queued request (its heap entry dies lazily). Call before changing its status."""
        tq = self._tenants.get(request.tenant)
        if tq is None or request.queue_seq < 0:
            return
        work = request.remaining_work_tokens
        tq.num_requests -= 1
        tq.num_tokens -= work
        tq.count(request.priority, -1, -work)
        self.num_requests -= 1
        self.num_tokens -= work
        request.queue_seq = -1
        if len(tq.heap) > 2 * tq.num_requests + COMPACT_SLACK:
            tq.heap = [entry for entry in tq.heap if _live(entry)]
            heapq.heapify(tq.heap)

    @property
    def num_entries(self) -> int:
        """Heap entries, live or not yet compacted: at most 2 x live + COMPACT_SLACK per tenant."""
        return sum(len(tq.heap) for tq in self._tenants.values())

    def _head(self, tenant: str, tq: _TenantQueue) -> tuple[QueueKey, Request] | None:
        heap = tq.heap
        while heap:
            if _live(heap[0]):
                return heap[0]
            heapq.heappop(heap)
        return None

    def peek(
        self,
        now: float,
        excluded: set[str] | frozenset[str] = frozenset(),
        tenant_order: Callable[[str], tuple] | None = None,
    ) -> Request | None:
        """The next request to admit, skipping `excluded` tenants. `tenant_order(tenant)` ranks
        tenants at the same level (lower first)."""
        heads: list[tuple[QueueKey, Request]] = []
        empty: list[str] = []
        for tenant, tq in self._tenants.items():
            head = self._head(tenant, tq)
            if head is None:
                if tq.num_requests == 0:
                    empty.append(tenant)
                continue
            if tenant not in excluded:
                heads.append(head)
        for tenant in empty:
            del self._tenants[tenant]
        if not heads:
            return None
        best = min(heads, key=lambda h: h[0])
        if not self.fairness or len(heads) == 1 or tenant_order is None:
            return best[1]
        level = self.level_of(best[1], now)
        same = [h for h in heads if self.level_of(h[1], now) <= level]
        if len(same) == 1:
            return best[1]
        return min(same, key=lambda h: (tenant_order(h[1].tenant), h[0]))[1]

    def pop(self, request: Request) -> None:
        """Take `request` (the one `peek` returned) out of the queue."""
        tq = self._tenants[request.tenant]
        head = self._head(request.tenant, tq)
        assert head is not None and head[1] is request, "pop() must take the request peek() returned"
        heapq.heappop(tq.heap)
        self.remove(request)

    def tenant_figures(self, tenant: str) -> tuple[int, int]:
        """(queued requests, queued tokens) of one tenant."""
        tq = self._tenants.get(tenant)
        return (tq.num_requests, tq.num_tokens) if tq else (0, 0)

    def fair_work_ahead(
        self,
        tenant: str,
        priority: int,
        tenant_share: Callable[[str], tuple[int, float]] | None = None,
    ) -> int:
        """Queued work (tokens) that the fair order would admit before a request of `tenant` at
        `priority` that arrives now; `tenant_share(t)` gives (running sequences, weight).

        Every request at a better level goes first. At the same level, tenants take turns by
        running sequences per weight (as `peek` with the scheduler's tenant order does): the new
        request is its tenant's k-th there (k-1 queued before it, FIFO within a tenant), and
        another tenant gets admitted about as many requests as keep its running-per-weight at
        ours by then, at its mean queued request size. Without fairness (or a share function) the
        whole level goes first. Aging is left out: a worse level that would age past the new
        request counts as behind it. O(tenants x levels), independent of the queue length."""
        own = self._tenants.get(tenant)
        own_level = own.by_priority.get(priority, (0, 0)) if own is not None else (0, 0)
        fair = self.fairness and tenant_share is not None
        if fair:
            own_running, own_weight = tenant_share(tenant)
            turns = own_running + own_level[0]  # our running count when the new request's turn comes
        ahead = 0
        for name, tq in self._tenants.items():
            for level, (n, tokens) in tq.by_priority.items():
                if level < priority:
                    ahead += tokens
                elif level == priority and name != tenant:
                    if not fair:
                        ahead += tokens
                        continue
                    running, weight = tenant_share(name)
                    served = min(n, max(0, math.ceil(turns * weight / own_weight) - running))
                    ahead += round(tokens * served / n)
        return ahead + own_level[1]

    @property
    def num_tenants(self) -> int:
        return sum(1 for tq in self._tenants.values() if tq.num_requests)

    def __iter__(self) -> Iterator[Request]:
        """Live queued requests in key order (O(n log n): reports and progress only)."""
        live = [entry for tq in self._tenants.values() for entry in tq.heap if _live(entry)]
        live.sort(key=lambda h: h[0])
        return iter([r for _, r in live])

    def position(self, request: Request) -> int | None:
        """How many live requests are ahead by key (0 = next); None if not queued."""
        if request.queue_seq < 0 or request.status is not RequestStatus.WAITING:
            return None
        key = self.key_of(request)
        return sum(1 for tq in self._tenants.values() for entry in tq.heap if entry[0] < key and _live(entry))
