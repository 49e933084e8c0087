"""Paged KV-cache bookkeeping: page allocator with ref counts, hash-chained prefix cache with LRU
eviction, copy-on-write for forks, swap to a CPU pool, pins for asynchronous copies, and compaction.

It moves no data: every method that needs bytes moved returns (src, dst) page pairs that the
executor hands to swap_blocks / copy_blocks before the step's forward pass, in this order:
swap-out, swap-in, copies. Page states (one at a time, for every device page):
  in use    ref > 0 (held by that many block tables; may also be registered in the prefix cache)
  cached    ref == 0, registered: kept in an LRU list, evicted oldest first when pages run out
  free      ref == 0, unregistered
  deferred  ref == 0, but a copy of this step still reads it: not handed out before end_step()
A pin (pin / unpin) is a hold without a block table: the CPU offload tier (offload.py) pins the pages an
asynchronous copy reads or writes, so a page freed by its sequence meanwhile is not handed out before the copy ends.

KV eviction (evict()): a sequence's kept tokens are gathered into fresh pages (the executor's gather_tokens launch,
before any other cache op of the step but compaction, which does not run in such a step); its old pages are read by
that copy, never written, so pages shared through the prefix cache or copy-on-write stay intact for their other
holders, and they return to the pool when the step's copies are done (the deferred rule). An evicted sequence's
pages no longer hold its prefix: they are never published to the prefix cache.

Fragmentation (fragmentation()): the share of the page ids below the highest live page (in use or cached) that are
not live, 1 - live / (highest live id + 1): 0 when the live pages are packed at the front. compact() packs them.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .sequence import Sequence


def page_hash(parent: int | None, tokens) -> int:
    """Hash of a full page: chained on the previous page's hash, so equal hashes mean equal prefixes."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little", signed=False))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class KVManager:
    def __init__(self, num_pages: int, page_size: int, num_cpu_pages: int = 0, enable_prefix_caching: bool = True):
        for name, v, lo in (("num_pages", num_pages, 1), ("page_size", page_size, 1),
                            ("num_cpu_pages", num_cpu_pages, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        self.num_pages, self.page_size, self.num_cpu_pages = num_pages, page_size, num_cpu_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages, oldest first
        self.page_to_hash: dict[int, int] = {}
        self.hash_to_page: dict[int, int] = {}
        self.seq_hashes: dict[int, list[int]] = {}        # seq_id -> hashes of its full pages, in order
        self.owners: dict[int, Sequence] = {}             # seq_id -> sequence holding device pages
        self.cpu_free: list[int] = list(range(num_cpu_pages - 1, -1, -1))
        self.cpu_tables: dict[int, list[int]] = {}        # seq_id -> its CPU pages while swapped
        self.cpu_pending_free: list[int] = []             # read by this step's swap-in; reusable next step
        self.copy_sources: set[int] = set()               # read by this step's copy_blocks ...
        self.deferred: list[int] = []                     # ... so if freed, not reused until next step
        self.pins: dict[int, int] = {}                    # page -> holds by asynchronous copies (pin / unpin)
        self.high_water = -1                              # no page above this id is live
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ---- capacity -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now (free + evictable cached)."""
        return len(self.free_pages) + len(self.lru)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_pages / self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _live(self, page: int) -> bool:
        return self.ref_count[page] > 0 or page in self.page_to_hash

    def fragmentation(self) -> tuple[float, int]:
        """(1 - live / (highest live page id + 1), holes): the share and number of the ids below the highest
        live page that hold nothing (0.0, 0 when the live pages are packed at the front or none is live)."""
        top = self.high_water  # no page above it was handed out since the last compaction
        while top >= 0 and not self._live(top):
            top -= 1
        self.high_water = top
        if top < 0:
            return 0.0, 0
        live = self.num_pages - len(self.free_pages) - sum(1 for p in self.deferred if p not in self.page_to_hash)
        holes = top + 1 - live
        return holes / (top + 1), holes

    # ---- page primitives ------------------------------------------------------------------------
    def _take_free_page(self) -> int:
        if self.free_pages:  # uncached pages first: keeps the prefix cache as long as possible
            page = self.free_pages.pop()
        else:
            page, _ = self.lru.popitem(last=False)
            del self.hash_to_page[self.page_to_hash.pop(page)]
        self.ref_count[page] = 1
        self.high_water = max(self.high_water, page)
        return page

    def _ref(self, page: int) -> None:
        if self.ref_count[page] == 0:  # a cached page comes back into use
            if page in self.lru:
                self.lru.pop(page)
            else:
                self.deferred.remove(page)
        self.ref_count[page] += 1

    def unref(self, page: int) -> None:
        if self.ref_count[page] <= 0:
            raise RuntimeError(f"page {page} freed twice")
        self.ref_count[page] -= 1
        if self.ref_count[page] == 0:
            if page in self.copy_sources:  # a copy still reads it this step: must not become a copy target
                self.deferred.append(page)
            elif page in self.page_to_hash:
                self.lru[page] = None  # most recently used end
            else:
                self.free_pages.append(page)

    def pin(self, page: int) -> None:
        """Hold page for an asynchronous copy (it must be held by a block table or freshly allocated)."""
        if self.ref_count[page] <= 0:
            raise RuntimeError(f"page {page} pinned while not held")
        self.ref_count[page] += 1
        self.pins[page] = self.pins.get(page, 0) + 1

    def unpin(self, page: int) -> None:
        """The copy is done: drop its hold (the page is freed or cached if no block table holds it)."""
        n = self.pins.get(page, 0)
        if n <= 0:
            raise RuntimeError(f"page {page} unpinned but not pinned")
        if n == 1:
            del self.pins[page]
        else:
            self.pins[page] = n - 1
        self.unref(page)

    def _unregister(self, page: int) -> None:
        h = self.page_to_hash.pop(page, None)
        if h is not None:
            del self.hash_to_page[h]

    # ---- prefix cache ---------------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_full_pages: int) -> list[int]:
        """The hash chain of seq's first num_full_pages pages (memoised per sequence)."""
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        P = self.page_size
        while len(hashes) < num_full_pages:
            i = len(hashes)
            hashes.append(page_hash(hashes[-1] if hashes else None, seq.token_ids[i * P:(i + 1) * P]))
        return hashes[:num_full_pages]

    def prefix_hashes(self, seq: Sequence) -> list[int]:
        """The hash chain a prefix match may use: seq's full pages, its last token excluded."""
        return self._hashes(seq, (seq.num_tokens - 1) // self.page_size)

    def computed_page_hashes(self, seq: Sequence) -> list[int]:
        """The hashes of seq's full, computed pages that its block table holds, in order (none once evicted)."""
        if seq.num_evicted:
            return []
        return self._hashes(seq, min(seq.num_computed_tokens // self.page_size, len(seq.block_table)))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached pages holding a prefix of seq (no side effects). The last token is never matched:
        the model must compute at least one position to produce logits."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in self.prefix_hashes(seq):
            page = self.hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def register_full_pages(self, seq: Sequence) -> None:
        """Publish seq's pages that are now full and computed (call after the forward pass)."""
        if not self.enable_prefix_caching or seq.num_evicted:
            return
        num_full = min(seq.num_computed_tokens // self.page_size, len(seq.block_table))
        for i, h in enumerate(self._hashes(seq, num_full)):
            page = seq.block_table[i]
            if h not in self.hash_to_page and page not in self.page_to_hash:
                self.hash_to_page[h], self.page_to_hash[page] = page, h

    # ---- allocation -----------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       prefix_pages: list[int] | None = None) -> list[tuple[int, int]] | None:
        """Make seq's block table cover positions [0, num_computed + num_new_tokens), first adopting
        prefix_pages (from match_prefix, for a sequence with no pages yet). Returns the CoW copies
        (src, dst) the step needs, or None, changing nothing, when there are not enough pages."""
        prefix_pages = prefix_pages or []
        if prefix_pages and seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds pages; prefix_pages is for admission only")
        table_len = len(seq.block_table) + len(prefix_pages)
        start = len(prefix_pages) * self.page_size if prefix_pages else seq.kv_len
        end = start + num_new_tokens
        # pages the write lands in that already exist: a shared one must be copied first
        shared = [i for i in range(start // self.page_size, min(table_len, self.pages_for(end)))
                  if i < len(seq.block_table) and self.ref_count[seq.block_table[i]] > 1]
        revived = sum(1 for p in prefix_pages if p in self.lru)  # cached pages leave the LRU
        needed = max(0, self.pages_for(end) - table_len) + len(shared) + revived
        if needed > self.num_free_pages:
            return None
        for page in prefix_pages:  # adopt before allocating, so eviction cannot take them
            self._ref(page)
        seq.block_table.extend(prefix_pages)
        copies = []
        for i in range(start // self.page_size, min(len(seq.block_table), self.pages_for(end))):
            src = seq.block_table[i]
            if i in shared:
                dst = self._take_free_page()
                self.copy_sources.add(src)
                self.unref(src)
                seq.block_table[i] = dst
                copies.append((src, dst))
            elif src in self.page_to_hash:  # sole owner rewrites a published page: unpublish it
                self._unregister(src)
        while len(seq.block_table) < self.pages_for(end):
            seq.block_table.append(self._take_free_page())
        self.owners[seq.seq_id] = seq
        return copies

    def free(self, seq: Sequence) -> None:
        """Drop seq's device pages (tail first, so a shared prefix outlives its tails in the LRU)."""
        for page in reversed(seq.block_table):
            self.unref(page)
        seq.block_table = []
        self.owners.pop(seq.seq_id, None)

    def release(self, seq: Sequence) -> None:
        """seq is done: free device and CPU pages and forget its hashes."""
        self.free(seq)
        self.cpu_free.extend(reversed(self.cpu_tables.pop(seq.seq_id, [])))
        self.seq_hashes.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence, num_pages: int | None = None) -> None:
        """child shares parent's first num_pages pages (all by default); writes will copy them."""
        pages = parent.block_table if num_pages is None else parent.block_table[:num_pages]
        if child.block_table:
            raise ValueError(f"child {child.seq_id} already holds pages")
        for page in pages:
            self._ref(page)
        child.block_table = list(pages)
        self.owners[child.seq_id] = child
        # only full computed pages are common history: the child's later tokens may differ
        num_full = min(len(pages), parent.num_computed_tokens // self.page_size)
        self.seq_hashes[child.seq_id] = list(self.seq_hashes.get(parent.seq_id, [])[:num_full])

    # ---- eviction -------------------------------------------------------------------------------
    def evict(self, seq: Sequence, keep: int) -> tuple[list[int], list[int]] | None:
        """Plan keeping `keep` of seq's kv_len cached tokens: fresh pages for them replace its block table, its old
        pages are released once this step's copies have read them. Returns (old pages, new pages) for the gather, or
        None, changing nothing, when the pages for the kept tokens are not free (the sequence keeps its cache)."""
        if not 0 < keep < seq.kv_len:
            raise ValueError(f"evict: keep must be in (0, kv_len={seq.kv_len}), got {keep}")
        need = self.pages_for(keep)
        if need > self.num_free_pages:
            return None
        old = list(seq.block_table)
        new = [self._take_free_page() for _ in range(need)]
        self.copy_sources.update(old)  # read by this step's gather: freed pages wait for end_step()
        for page in reversed(old):
            self.unref(page)
        seq.block_table = new
        seq.num_evicted += seq.kv_len - keep
        self.seq_hashes.pop(seq.seq_id, None)
        return old, new

    # ---- swap -----------------------------------------------------------------------------------
    def end_step(self) -> None:
        """The step's swaps and copies have run: the pages they read may be overwritten from now on."""
        self.cpu_free.extend(self.cpu_pending_free)
        self.cpu_pending_free = []
        self.copy_sources = set()
        deferred, self.deferred = self.deferred, []
        for page in deferred:
            self.ref_count[page] = 1
            self.unref(page)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move seq's pages to the CPU pool: returns (device page, cpu page) pairs, or None if the
        pool is too small (nothing changes)."""
        if len(seq.block_table) > len(self.cpu_free):
            return None
        mapping = [(page, self.cpu_free.pop()) for page in seq.block_table]
        self.cpu_tables[seq.seq_id] = [cpu for _, cpu in mapping]
        self.free(seq)
        return mapping

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Bring a swapped seq back: returns (cpu page, device page) pairs, or None if device pages
        are short (nothing changes). Full pages still in the prefix cache are adopted, not copied."""
        cpu_pages = self.cpu_tables[seq.seq_id]
        known = self.seq_hashes.get(seq.seq_id, []) if self.enable_prefix_caching else []
        reuse = {i: self.hash_to_page[h] for i, h in enumerate(known[:len(cpu_pages)]) if h in self.hash_to_page}
        needed = len(cpu_pages) - len(reuse) + sum(1 for p in reuse.values() if p in self.lru)
        if needed > self.num_free_pages:
            return None
        for page in reuse.values():
            self._ref(page)
        table, mapping = [], []
        for i, cpu in enumerate(cpu_pages):
            if i in reuse:
                table.append(reuse[i])
            else:
                table.append(self._take_free_page())
                mapping.append((cpu, table[-1]))
        seq.block_table = table
        self.owners[seq.seq_id] = seq
        self.cpu_pending_free.extend(self.cpu_tables.pop(seq.seq_id))
        self.register_full_pages(seq)
        return mapping

    # ---- compaction -----------------------------------------------------------------------------
    def compact(self) -> list[tuple[int, int]]:
        """Plan copy_blocks moves packing live pages (in use or cached) into the lowest ids; updates
        every block table and the cache. The moves run before any other cache op of the step (ScheduledBatch.moves,
        their own copy_blocks launch); never while an asynchronous copy holds pages (RuntimeError)."""
        if self.pins:
            raise RuntimeError(f"compact: {len(self.pins)} pages are pinned by asynchronous copies")
        self.end_step()
        live = [p for p in range(self.num_pages) if self._live(p)]
        holes = [p for p in range(len(live)) if not self._live(p)]
        moves = list(zip([p for p in live if p >= len(live)], holes))
        if not moves:
            return []
        where = dict(moves)
        for seq in self.owners.values():
            seq.block_table = [where.get(p, p) for p in seq.block_table]
        for src, dst in moves:
            self.ref_count[dst], self.ref_count[src] = self.ref_count[src], 0
            if src in self.page_to_hash:
                h = self.page_to_hash.pop(src)
                self.page_to_hash[dst], self.hash_to_page[h] = h, dst
        self.lru = OrderedDict((where.get(p, p), None) for p in self.lru)
        self.free_pages = list(range(self.num_pages - 1, len(live) - 1, -1))
        self.high_water = len(live) - 1
        return moves

    # ---- checks (tests and debugging) -----------------------------------------------------------
    def check_invariants(self) -> None:
        held = [0] * self.num_pages
        for seq in self.owners.values():
            for p in seq.block_table:
                held[p] += 1
        for p, n in self.pins.items():
            assert n > 0, f"page {p} listed with {n} pins"
            held[p] += n
        assert held == self.ref_count, f"ref counts {self.ref_count} != block-table holds {held}"
        free, lru, deferred = set(self.free_pages), set(self.lru), set(self.deferred)
        assert len(free) == len(self.free_pages) and len(deferred) == len(self.deferred), "a page listed twice"
        assert deferred <= self.copy_sources
        for p in range(self.num_pages):
            in_use, cached, held_back = self.ref_count[p] > 0, p in self.page_to_hash, p in deferred
            assert not (held_back and in_use), f"page {p} deferred while in use"
            assert (p in free) == (not in_use and not cached and not held_back), f"page {p} free-list state wrong"
            assert (p in lru) == (not in_use and cached and not held_back), f"page {p} LRU state wrong"
        assert all(self.hash_to_page[h] == p for p, h in self.page_to_hash.items())
        above = range(self.high_water + 1, self.num_pages)
        assert not any(self.ref_count[p] or p in self.page_to_hash for p in above), "a live page above high_water"
        assert len(self.hash_to_page) == len(self.page_to_hash)
        cpu = self.cpu_free + self.cpu_pending_free + [c for t in self.cpu_tables.values() for c in t]
        assert sorted(cpu) == list(range(self.num_cpu_pages)), "a CPU page is leaked or held twice"
