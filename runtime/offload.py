"""The CPU offload tier of the KV cache: full, computed KV pages copied into a pool of host pages (pinned on CUDA),
keyed by their prefix-cache hash (kv_manager.page_hash: equal hashes, equal prefixes), so what it holds serves any
sequence with that prefix: a sequence preempted after its pages were copied, or a prefix the GPU prefix cache evicted
(two-level prefix hits).

A step's copies are one OffloadPlan, planned by the scheduler (save: device -> tier pages of running sequences,
those it would preempt first first, ahead of memory pressure; restore: tier -> device pages of a sequence coming
back) and launched by the executor on a copy engine, which hands back a Ticket. Until its ticket is done a plan's
device pages stay pinned in the KV manager (neither reused nor moved by compaction), a saved entry is not ready (a
lookup treats it as absent) and a restoring sequence is not scheduled. Fail-closed: a page the tier has no room for
is not saved, an entry not ready is not restored; either way the tokens are recomputed, and counted.

Copy engines: StreamCopies (CUDA: the copies run on their own stream, after the work queued so far on the compute
stream, and an event says when they are done) and SyncCopies (CPU: the copies run at once). Anything with
submit(launch) -> Ticket is one: the tests hold tickets back to play a copy that has not finished.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol


class Ticket(Protocol):
    def done(self) -> bool: ...
    def wait(self) -> None: ...


class DoneTicket:
    """A copy that has already run."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


DONE = DoneTicket()


class SyncCopies:
    """The CPU's copy engine: runs the copies when they are submitted."""

    def submit(self, launch: Callable[[], object]) -> Ticket:
        launch()
        return DONE


@dataclass
class EventTicket:
    event: object      # torch.cuda.Event recorded after the copies on the copy stream
    keep: object = None  # what the copies read until they finish (their page mappings)

    def done(self) -> bool:
        if self.event.query():
            self.keep = None
            return True
        return False

    def wait(self) -> None:
        self.event.synchronize()
        self.keep = None


class StreamCopies:
    """CUDA: each submission waits for the work queued on the current (compute) stream, then runs on a stream of
    its own, so the copies overlap the steps that follow; its ticket is done once its event has passed."""

    def __init__(self, device=None):
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream(device)

    def submit(self, launch: Callable[[], object]) -> Ticket:
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            keep = launch()
            event = torch.cuda.Event()
            event.record(self.stream)
        return EventTicket(event, keep)


@dataclass
class OffloadPlan:
    """A step's copies between the device pages and the tier pages, launched together."""

    save: list[tuple[int, int]] = field(default_factory=list)     # (device page, tier page)
    restore: list[tuple[int, int]] = field(default_factory=list)  # (tier page, device page)
    ticket: Ticket | None = None  # set by whoever launches the copies

    def __bool__(self) -> bool:
        return bool(self.save or self.restore)

    def done(self) -> bool:
        return self.ticket is not None and self.ticket.done()


@dataclass
class _Entry:
    page: int
    ready: bool = False  # its save has finished


@dataclass
class _InFlight:
    plan: OffloadPlan
    saved: list[int]                                # hashes the plan saves
    device_pages: list[int]                         # pinned in the KV manager until the plan is done
    restoring: list = field(default_factory=list)   # sequences whose pages the plan restores


@dataclass
class TierStats:
    pages_offloaded: int = 0         # saves finished
    pages_restored: int = 0          # restores finished
    hit_tokens: int = 0              # prefix tokens served from the tier (prefix hits of the CPU tier)
    pages_evicted: int = 0           # entries dropped, least recently used first, to make room for a save
    pages_not_saved: int = 0         # fail-closed: no room in the tier (every tier page held by a copy)
    pages_not_ready: int = 0         # fail-closed: a lookup stopped at an entry whose save had not finished


class OffloadTier:
    """Bookkeeping of the tier's num_pages host pages: entries by hash, least recently used first, evicted when a
    save needs room (never one that a copy in flight writes or reads)."""

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.entries: OrderedDict[int, _Entry] = OrderedDict()  # hash -> entry, oldest first
        self.reads: dict[int, int] = {}  # tier page -> restores in flight reading it
        self.inflight: list[_InFlight] = []
        self.cursor: dict[int, int] = {}  # seq_id -> how many of its leading pages plan_saves has handled
        self.stats = TierStats()

    # ---- lookups --------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Copies in flight (the KV manager holds pins for them)."""
        return bool(self.inflight)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def __contains__(self, h: int) -> bool:
        return h in self.entries

    def match(self, hashes: list[int]) -> list[int]:
        """Tier pages of the longest run of hashes held and ready (used: moved to the recent end)."""
        pages = []
        for h in hashes:
            e = self.entries.get(h)
            if e is None:
                break
            if not e.ready:
                self.stats.pages_not_ready += 1
                break
            self.entries.move_to_end(h)
            pages.append(e.page)
        return pages

    def touch(self, hashes: list[int]) -> None:
        """Move the entries of hashes held to the recent end (a preempted sequence's: evicted last)."""
        for h in hashes:
            if h in self.entries:
                self.entries.move_to_end(h)

    # ---- planning -------------------------------------------------------------------------------
    def _reserve(self, h: int) -> int | None:
        if not self.free:
            victim = next((k for k, e in self.entries.items() if e.ready and e.page not in self.reads), None)
            if victim is None:
                return None
            self.free.append(self.entries.pop(victim).page)
            self.stats.pages_evicted += 1
        page = self.free.pop()
        self.entries[h] = _Entry(page)
        return page

    def plan_saves(self, kv, seqs, max_pages: int, plan: OffloadPlan) -> list[int]:
        """Add to plan the saves of seqs' full computed pages the tier lacks, seqs in order, at most max_pages;
        returns the hashes saved. Pins the device pages they read."""
        saved = []
        for seq in seqs:
            hashes = kv.computed_page_hashes(seq)
            i = self.cursor.get(seq.seq_id, 0)  # its pages before i are saved (or were, if evicted since)
            while i < len(hashes):
                if len(saved) >= max_pages:
                    break
                h = hashes[i]
                if h not in self.entries:
                    page = self._reserve(h)
                    if page is None:
                        self.stats.pages_not_saved += 1
                        self.cursor[seq.seq_id] = i
                        return saved
                    kv.pin(seq.block_table[i])
                    plan.save.append((seq.block_table[i], page))
                    saved.append(h)
                i += 1
            self.cursor[seq.seq_id] = i
            if len(saved) >= max_pages:
                break
        return saved

    def forget(self, seq_id: int) -> None:
        """seq is done: drop its save cursor (what it saved stays, for any sequence with that prefix)."""
        self.cursor.pop(seq_id, None)

    def plan_restore(self, kv, tier_pages: list[int], device_pages: list[int], plan: OffloadPlan) -> None:
        """Add to plan the restore of tier_pages into device_pages (freshly allocated); pins both."""
        for t, d in zip(tier_pages, device_pages, strict=True):
            kv.pin(d)
            self.reads[t] = self.reads.get(t, 0) + 1
            plan.restore.append((t, d))

    def launched(self, plan: OffloadPlan, saved: list[int], restoring: list) -> None:
        """Track the step's plan until its ticket is done."""
        if plan:
            pages = [d for d, _ in plan.save] + [d for _, d in plan.restore]
            self.inflight.append(_InFlight(plan, saved, pages, list(restoring)))

    # ---- completion -----------------------------------------------------------------------------
    def _complete(self, kv, f: _InFlight) -> list:
        for h in f.saved:
            e = self.entries.get(h)
            if e is not None:
                e.ready = True
        for t, _ in f.plan.restore:
            n = self.reads.pop(t) - 1
            if n:
                self.reads[t] = n
        for page in f.device_pages:
            kv.unpin(page)
        self.stats.pages_offloaded += len(f.plan.save)
        self.stats.pages_restored += len(f.plan.restore)
        return f.restoring

    def poll(self, kv) -> list:
        """Finish the plans whose copies are done (in launch order); returns the sequences they restored."""
        restored = []
        while self.inflight and self.inflight[0].plan.done():
            restored += self._complete(kv, self.inflight.pop(0))
        return restored

    def wait_oldest(self, kv) -> list:
        """Block until the oldest plan's copies are done (a plan never launched cannot be waited for)."""
        f = self.inflight[0]
        if f.plan.ticket is None:
            raise RuntimeError("offload: waiting for copies that were never launched (ScheduledBatch.offload "
                               "not run by the executor)")
        f.plan.ticket.wait()
        return self.poll(kv)

    # ---- checks (tests and debugging) -----------------------------------------------------------
    def check_invariants(self) -> None:
        pages = sorted(self.free + [e.page for e in self.entries.values()])
        assert pages == list(range(self.num_pages)), "a tier page is leaked or held twice"
        assert all(self.entries_by_page().get(t) is not None for t in self.reads), "a restore reads a free page"

    def entries_by_page(self) -> dict[int, int]:
        return {e.page: h for h, e in self.entries.items()}


__all__ = ["Ticket", "DoneTicket", "DONE", "SyncCopies", "StreamCopies", "EventTicket", "OffloadPlan", "OffloadTier",
           "TierStats"]
