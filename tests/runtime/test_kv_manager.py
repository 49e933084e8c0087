"""KV manager invariants. A fake cache (one int per slot: a hash of the token prefix it was computed
from) stands in for K/V, so every read through a block table checks CoW isolation, swap round
trips and prefix-cache hits bit-exactly."""
import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from uacompile.runtime.kv_manager import KVManager, page_hash
from uacompile.runtime.sequence import SamplingParams, Sequence

POISON = -1


def slot_value(tokens) -> int:
    """What the 'model' writes at the last position of tokens: depends on the whole prefix."""
    return int.from_bytes(hashlib.blake2b(np.asarray(tokens, np.int64).tobytes(), digest_size=7).digest(), "little")


def make_seq(seq_id, tokens):
    return Sequence(seq_id, list(tokens), len(tokens), SamplingParams())


class KVMachine(RuleBasedStateMachine):
    """Random allocate / extend / fork / free / swap / compact, against a fake content array."""

    def __init__(self):
        super().__init__()
        self.kv = None

    @rule(num_pages=st.integers(2, 12), page_size=st.sampled_from([1, 2, 4]), num_cpu=st.integers(0, 12),
          caching=st.booleans())
    @precondition(lambda self: self.kv is None)
    def setup(self, num_pages, page_size, num_cpu, caching):
        self.kv = KVManager(num_pages, page_size, num_cpu, caching)
        self.P = page_size
        self.dev = np.full((num_pages, page_size), POISON, np.int64)
        self.cpu = np.full((max(num_cpu, 1), page_size), POISON, np.int64)
        self.active: dict[int, Sequence] = {}
        self.swapped: dict[int, Sequence] = {}
        self.next_id = 0

    # -- helpers --
    def _allocate_and_compute(self, seq, num_new, prefix=None):
        kv, before_lru, free_before = self.kv, list(self.kv.lru), self.kv.num_free_pages
        table_before = list(seq.block_table)
        copies = kv.allocate_slots(seq, num_new, prefix)
        if copies is None:  # refused: nothing changed
            assert seq.block_table == table_before and kv.num_free_pages == free_before
            return False
        # LRU: pages that left the cache without being adopted were evicted, oldest first, and only
        # once no uncached free page was left
        adopted = set(prefix or [])
        evicted = [p for p in before_lru if p not in kv.lru and p not in adopted]
        assert evicted == [p for p in before_lru if p not in adopted][:len(evicted)], "eviction not oldest-first"
        if evicted:
            assert not kv.free_pages, "evicted a cached page while an uncached one was free"
        if prefix:
            seq.num_computed_tokens = len(prefix) * self.P
        srcs, dsts = {s for s, _ in copies}, {d for _, d in copies}
        assert not srcs & dsts
        for src, dst in copies:
            self.dev[dst] = self.dev[src]
        start = seq.num_computed_tokens
        for pos in range(start, start + num_new):
            self.dev[seq.block_table[pos // self.P], pos % self.P] = slot_value(seq.token_ids[:pos + 1])
        seq.num_computed_tokens += num_new
        kv.register_full_pages(seq)
        return True

    def _check_content(self, seq, store, table):
        for pos in range(seq.num_computed_tokens):
            got = store[table[pos // self.P], pos % self.P]
            assert got == slot_value(seq.token_ids[:pos + 1]), f"seq {seq.seq_id} pos {pos} corrupted"

    # -- rules --
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20), data=st.data())
    @precondition(lambda self: self.kv is not None)
    def new_sequence(self, tokens, data):
        seq = make_seq(self.next_id, tokens)
        self.next_id += 1
        prefix = self.kv.match_prefix(seq)
        assert len(prefix) * self.P < len(tokens)
        remaining = len(tokens) - len(prefix) * self.P
        num_new = data.draw(st.integers(1, remaining))
        if self._allocate_and_compute(seq, num_new, prefix):
            self.active[seq.seq_id] = seq

    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=6))
    @precondition(lambda self: self.kv is not None and self.active)
    def extend(self, data, extra):
        seq = self.active[data.draw(st.sampled_from(sorted(self.active)))]
        seq.token_ids.extend(extra)
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining:
            self._allocate_and_compute(seq, data.draw(st.integers(1, remaining)))

    @rule(data=st.data())
    @precondition(lambda self: self.kv is not None and self.active)
    def fork(self, data):
        parent = self.active[data.draw(st.sampled_from(sorted(self.active)))]
        child = make_seq(self.next_id, parent.token_ids[:parent.num_computed_tokens])
        self.next_id += 1
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.active[child.seq_id] = child

    @rule(data=st.data())
    @precondition(lambda self: self.kv is not None and self.active)
    def release(self, data):
        seq = self.active.pop(data.draw(st.sampled_from(sorted(self.active))))
        self.kv.release(seq)

    @rule(data=st.data())
    @precondition(lambda self: self.kv is not None and self.active)
    def swap_out(self, data):
        seq = self.active[data.draw(st.sampled_from(sorted(self.active)))]
        table = list(seq.block_table)
        mapping = self.kv.swap_out(seq)
        if mapping is None:
            assert seq.block_table == table
            return
        assert [d for d, _ in mapping] == table and len({c for _, c in mapping}) == len(mapping)
        for d, c in mapping:
            self.cpu[c] = self.dev[d]
        self._check_content(seq, self.cpu, self.kv.cpu_tables[seq.seq_id])
        self.swapped[seq.seq_id] = self.active.pop(seq.seq_id)

    @rule(data=st.data())
    @precondition(lambda self: self.kv is not None and self.swapped)
    def swap_in(self, data):
        seq = self.swapped[data.draw(st.sampled_from(sorted(self.swapped)))]
        mapping = self.kv.swap_in(seq)
        if mapping is None:
            assert not seq.block_table
            return
        for c, d in mapping:
            self.dev[d] = self.cpu[c]
        self.active[seq.seq_id] = self.swapped.pop(seq.seq_id)

    @rule()
    @precondition(lambda self: self.kv is not None)
    def step_boundary(self):
        self.kv.end_step()

    @rule()
    @precondition(lambda self: self.kv is not None)
    def compact(self):
        live = sum(1 for p in range(self.kv.num_pages) if self.kv.ref_count[p] or p in self.kv.page_to_hash)
        moves = self.kv.compact()
        assert not {s for s, _ in moves} & {d for _, d in moves}
        for src, dst in moves:
            self.dev[dst], self.dev[src] = self.dev[src], POISON
        used = [p for p in range(self.kv.num_pages) if self.kv.ref_count[p] or p in self.kv.page_to_hash]
        assert used == list(range(live)), "live pages not packed to the front"

    # -- invariants --
    @invariant()
    def consistent(self):
        if self.kv is None:
            return
        self.kv.check_invariants()
        assert set(self.kv.owners) == {s.seq_id for s in self.active.values() if s.block_table}
        for seq in self.active.values():
            assert len(seq.block_table) == self.kv.pages_for(seq.num_computed_tokens)
            self._check_content(seq, self.dev, seq.block_table)
        for seq in self.swapped.values():
            self._check_content(seq, self.cpu, self.kv.cpu_tables[seq.seq_id])
        # cached pages hold exactly what their hash chain says (checked through any holder above;
        # here: a registered page is full)
        for page in self.kv.page_to_hash:
            assert (self.dev[page] != POISON).all()


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


# ---- focused cases ------------------------------------------------------------------------------
def _filled(kv, seq_id, tokens):
    seq = make_seq(seq_id, tokens)
    assert kv.allocate_slots(seq, len(tokens)) is not None
    seq.num_computed_tokens = len(tokens)
    kv.register_full_pages(seq)
    return seq


def test_lru_evicts_oldest_freed_first_and_tails_before_heads():
    kv = KVManager(num_pages=6, page_size=2)
    a = _filled(kv, 0, [1, 1, 1, 2])      # pages 0, 1
    b = _filled(kv, 1, [2, 2, 2, 3])      # pages 2, 3
    kv.release(a)
    kv.release(b)
    assert list(kv.lru) == [1, 0, 3, 2]   # a's tail, a's head, b's tail, b's head
    # a hit moves a's head page to the most-recent end when it is freed again
    c = make_seq(2, [1, 1, 9])
    prefix = kv.match_prefix(c)
    assert prefix == [0]
    assert kv.allocate_slots(c, 1, prefix) is not None   # page 0 adopted, one fresh page (4)
    assert c.block_table == [0, 4]
    kv.release(c)
    assert list(kv.lru) == [1, 3, 2, 0]
    d = make_seq(3, [5] * 8)              # needs 4 pages: free page 5 and 4 first, then evict 1, 3
    assert kv.allocate_slots(d, 8) is not None
    assert sorted(d.block_table[:2]) == [4, 5] and d.block_table[2:] == [1, 3]
    assert list(kv.lru) == [2, 0]
    assert kv.match_prefix(make_seq(4, [1, 1, 1, 2, 7])) == [0]  # a's head still cached, its tail gone
    kv.check_invariants()


def test_cow_copies_shared_partial_page_only():
    kv = KVManager(num_pages=8, page_size=4)
    parent = _filled(kv, 0, [1, 2, 3, 4, 5, 6])
    child = make_seq(1, parent.token_ids)
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    assert kv.ref_count[parent.block_table[0]] == 2 and kv.ref_count[parent.block_table[1]] == 2
    child.append_token(9)
    copies = kv.allocate_slots(child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert kv.ref_count[parent.block_table[1]] == 1
    parent.append_token(8)
    assert kv.allocate_slots(parent, 1) == []   # parent is now the sole owner: writes in place
    kv.check_invariants()


def test_swap_in_adopts_pages_still_cached():
    kv = KVManager(num_pages=4, page_size=2, num_cpu_pages=4)
    seq = _filled(kv, 0, [1, 2, 3])        # page 0 full and registered, page 1 partial
    out = kv.swap_out(seq)
    assert [d for d, _ in out] == [0, 1]
    back = kv.swap_in(seq)
    assert seq.block_table[0] == 0 and [c for c, _ in back] == [out[1][1]]  # only the partial page copied
    kv.check_invariants()


def test_cpu_pages_read_by_swap_in_are_not_reused_in_the_same_step():
    kv = KVManager(num_pages=4, page_size=2, num_cpu_pages=1, enable_prefix_caching=False)
    a = _filled(kv, 0, [1])
    assert kv.swap_out(a) is not None
    kv.swap_in(a)
    assert kv.swap_out(a) is None          # the one CPU page is still being read this step
    kv.end_step()
    assert kv.swap_out(a) is not None
    kv.check_invariants()


def test_refused_allocation_changes_nothing_and_double_free_is_caught():
    kv = KVManager(num_pages=2, page_size=2)
    a = _filled(kv, 0, [1, 2, 3])
    b = make_seq(1, [4, 5, 6])
    assert kv.allocate_slots(b, 3) is None and b.block_table == [] and kv.num_free_pages == 0
    page = a.block_table[0]
    kv.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        kv.unref(page)


@pytest.mark.parametrize("kwargs, name", [({"num_pages": 0, "page_size": 4}, "num_pages"),
                                          ({"num_pages": 4, "page_size": 0}, "page_size"),
                                          ({"num_pages": 4, "page_size": 4, "num_cpu_pages": -1}, "num_cpu_pages")])
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        KVManager(**kwargs)


def test_page_hash_chains_on_the_prefix():
    assert page_hash(None, [1, 2]) == page_hash(None, [1, 2])
    assert page_hash(page_hash(None, [1, 2]), [3, 4]) != page_hash(page_hash(None, [2, 1]), [3, 4])


def test_fork_mid_page_does_not_inherit_hashes_of_the_parents_uncomputed_tokens():
    kv = KVManager(num_pages=8, page_size=2)
    parent = make_seq(0, [1, 2, 3, 4, 5])
    assert kv.match_prefix(parent) == []       # hashes pages [1,2] and [3,4] of the parent
    assert kv.allocate_slots(parent, 3) is not None
    parent.num_computed_tokens = 3             # page [3, 4] is half computed
    kv.register_full_pages(parent)
    child = make_seq(1, [1, 2, 3])
    kv.fork(parent, child)
    child.num_computed_tokens = 3
    child.append_token(9)                      # the child's page 1 becomes [3, 9]
    assert kv.allocate_slots(child, 1) is not None
    child.num_computed_tokens = 4
    kv.register_full_pages(child)
    # a request for [1, 2, 3, 4, ...] must not be handed the child's [3, 9] page
    assert kv.match_prefix(make_seq(2, [1, 2, 3, 4, 5])) == [parent.block_table[0]]


def test_a_freed_copy_source_is_not_reused_in_the_same_step():
    kv = KVManager(num_pages=3, page_size=2, enable_prefix_caching=False)
    a = _filled(kv, 0, [1])
    b = make_seq(1, [1])
    kv.fork(a, b)
    b.num_computed_tokens = 1
    b.append_token(2)
    [(src, dst)] = kv.allocate_slots(b, 1)     # b copies the shared page; the copy reads src this step
    kv.free(a)                                 # src's last holder goes (e.g. preempted in the same step)
    assert kv.num_free_pages == 1 and src not in kv.free_pages
    c = make_seq(2, [3, 4, 5])
    assert kv.allocate_slots(c, 3) is None     # src cannot be written while the copy may still read it
    kv.end_step()
    assert kv.num_free_pages == 2 and kv.allocate_slots(c, 3) is not None
    kv.check_invariants()


def test_a_pinned_page_outlives_its_sequence_until_unpinned():
    kv = KVManager(num_pages=3, page_size=2)
    a = _filled(kv, 0, [1, 2, 3])          # pages 0 (full, registered) and 1
    kv.pin(a.block_table[0])
    kv.free(a)
    assert kv.num_free_pages == 2 and kv.ref_count[0] == 1 and 0 not in kv.lru
    assert kv.match_prefix(make_seq(1, [1, 2, 9])) == [0]  # still registered: readable, never handed out
    with pytest.raises(RuntimeError, match="pinned by asynchronous copies"):
        kv.compact()
    kv.check_invariants()
    kv.unpin(0)
    assert list(kv.lru) == [0] and not kv.pins
    with pytest.raises(RuntimeError, match="unpinned but not pinned"):
        kv.unpin(0)
    with pytest.raises(RuntimeError, match="pinned while not held"):
        kv.pin(2)
    kv.check_invariants()


def test_fragmentation_is_the_share_of_holes_below_the_highest_live_page():
    kv = KVManager(num_pages=8, page_size=2, enable_prefix_caching=False)
    assert kv.fragmentation() == (0.0, 0)
    seqs = [_filled(kv, i, [i + 1] * 2) for i in range(4)]  # pages 0..3
    assert kv.fragmentation() == (0.0, 0)
    kv.release(seqs[0]), kv.release(seqs[2])
    assert kv.fragmentation() == (0.5, 2)  # pages 0 and 2 empty below page 3
    moves = kv.compact()
    assert sorted(d for _, d in moves) == [0] and kv.fragmentation() == (0.0, 0)
    kv.check_invariants()


def test_fragmentation_agrees_with_a_scan_of_every_page(rng):
    kv = KVManager(num_pages=64, page_size=2)
    seqs = {}
    for step in range(400):
        if seqs and rng.random() < 0.45:
            kv.release(seqs.pop(int(rng.choice(list(seqs)))))
        else:
            toks = rng.integers(1, 4, int(rng.integers(1, 9))).tolist()
            if kv.num_free_pages >= kv.pages_for(len(toks)):
                seqs[step] = _filled(kv, step, toks)
        if rng.random() < 0.05:
            kv.compact()
        live = [p for p in range(64) if kv.ref_count[p] or p in kv.page_to_hash]
        want = (0.0, 0) if not live else (1 - len(live) / (live[-1] + 1), live[-1] + 1 - len(live))
        got = kv.fragmentation()
        assert got[1] == want[1] and got[0] == pytest.approx(want[0]), step
        kv.check_invariants()


def test_evict_moves_into_fresh_pages_and_frees_the_old_after_the_step():
    kv = KVManager(12, 4)
    a = make_seq(0, range(1, 19))
    assert kv.allocate_slots(a, 18) == []
    a.num_computed_tokens = 18
    kv.register_full_pages(a)
    b = make_seq(1, range(1, 19))
    kv.fork(a, b)  # b shares every page: eviction must only read them
    old = list(a.block_table)
    assert kv.evict(a, 6) == (old, a.block_table)
    assert len(a.block_table) == 2 and not set(old) & set(a.block_table) and a.kv_len == 6 and a.num_evicted == 12
    assert all(kv.ref_count[p] == 1 for p in old)  # b's holds
    kv.free(b)
    assert kv.num_free_pages == 12 - 2 - 5 and set(old) <= set(kv.deferred)  # read by this step's gather
    kv.end_step()
    assert kv.num_free_pages == 10 and all(p in kv.lru or p in kv.free_pages for p in old)
    kv.register_full_pages(a)  # an evicted sequence's pages never hold its prefix
    assert not set(a.block_table) & set(kv.page_to_hash) and kv.computed_page_hashes(a) == []
    kv.check_invariants()
    with pytest.raises(ValueError, match="keep must be in"):
        kv.evict(a, 6)


def test_evict_without_pages_changes_nothing():
    kv = KVManager(5, 4, enable_prefix_caching=False)
    a = make_seq(0, range(1, 20))
    kv.allocate_slots(a, 19)
    a.num_computed_tokens = 19
    table = list(a.block_table)
    assert kv.evict(a, 8) is None and a.block_table == table and a.num_evicted == 0
    kv.check_invariants()
