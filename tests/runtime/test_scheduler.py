"""Scheduler tests. A fake executor plays the model: it runs the batch's swap/copy mappings on a fake
KV cache (one int per slot, a hash of the token prefix), writes the new tokens' slots, reads every
visible slot back through the page table (any aliasing, lost CoW or bad swap shows up), and samples a
token from what it read. Generation must then equal a one-sequence-at-a-time reference."""
import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from uacompile.runtime.offload import SyncCopies
from uacompile.runtime.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from uacompile.runtime.sequence import SamplingParams, Sequence, SequenceStatus
from uacompile.runtime.step import host_step

VOCAB, OUT_VOCAB, EOS, POISON = 6, 16, 0, -1  # small prompt vocabulary: prefixes repeat


def slot_value(tokens) -> int:
    return int.from_bytes(hashlib.blake2b(np.asarray(tokens, np.int64).tobytes(), digest_size=7).digest(), "little")


def next_token(seed, values) -> int:
    h = hashlib.blake2b(np.asarray([seed or 0, *values], np.int64).tobytes(), digest_size=4)
    return int.from_bytes(h.digest(), "little") % OUT_VOCAB


def reference_output(prompt, params) -> list[int]:
    tokens = list(prompt)
    while True:
        tokens.append(next_token(params.seed, [slot_value(tokens[:i + 1]) for i in range(len(tokens))]))
        out = tokens[len(prompt):]
        if len(out) == params.max_tokens or (out[-1] == EOS and not params.ignore_eos):
            return out


class FakeExecutor:
    """copies: the offload tier's copy engine (offload.SyncCopies: at once); its launch moves the fake KV when it
    runs, so a copy held back reads and writes pages as they are when it is released."""

    def __init__(self, cfg: SchedulerConfig, copies=None):
        self.P = cfg.page_size
        self.dev = np.full((cfg.num_pages, cfg.page_size), POISON, np.int64)
        self.cpu = np.full((max(cfg.num_cpu_pages, 1), cfg.page_size), POISON, np.int64)
        self.tier = np.full((max(cfg.num_offload_pages, 1), cfg.page_size), POISON, np.int64)
        self.copies = copies or SyncCopies()

    def launch_offload(self, plan):
        def launch():
            for d, t in plan.save:
                self.tier[t] = self.dev[d]
            for t, d in plan.restore:
                self.dev[d] = self.tier[t]

        plan.ticket = self.copies.submit(launch)

    def execute(self, batch: ScheduledBatch) -> dict[int, int]:
        if batch.moves:  # compaction: its own copy_blocks launch, before everything else
            src, dst = np.array(batch.moves).T
            assert not set(src) & set(dst)
            self.dev[dst] = self.dev[src]
            self.dev[src] = POISON
        for d, c in batch.swap_out:
            self.cpu[c] = self.dev[d]
        for c, d in batch.swap_in:
            self.dev[d] = self.cpu[c]
        if batch.copies:  # one copy_blocks launch: sources and destinations must not overlap
            src, dst = np.array(batch.copies).T
            assert not set(src) & set(dst)
            self.dev[dst] = self.dev[src]
        if batch.offload:
            self.launch_offload(batch.offload)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):  # reshape_and_cache for the whole batch
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.dev[seq.block_table[pos // self.P], pos % self.P] = slot_value(seq.token_ids[:pos + 1])
        sampled = {}
        for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.sample):  # then attention
            end = seq.num_computed_tokens + n
            seen = [self.dev[seq.block_table[j // self.P], j % self.P] for j in range(end)]
            assert seen == [slot_value(seq.token_ids[:j + 1]) for j in range(end)], f"seq {seq.seq_id} read bad KV"
            if sample:
                sampled[seq.seq_id] = next_token(seq.params.seed, seen)
        return sampled


def run(cfg: SchedulerConfig, requests, max_steps=5000, abort_rng=None, copies=None):
    """requests: (prompt, SamplingParams, priority). Drives the scheduler like the engine does (with
    abort_rng: aborts a random live sequence now and then; copies: the offload tier's copy engine); returns
    ({request index: [outputs of its n samples]}, scheduler, batches seen)."""
    sched, ex = Scheduler(cfg), FakeExecutor(cfg, copies)
    groups = []
    for i, (prompt, params, prio) in enumerate(requests):
        seq = Sequence(i, list(prompt), len(prompt), params, priority=prio)
        sched.add(seq)
        children = sched.fork(seq, params.n, [1000 * (i + 1) + k for k in range(params.n - 1)]) if params.n > 1 else []
        groups.append([seq] + children)
    batches = 0
    while sched.has_unfinished():
        running_decodes = [s for s in sched.running if s.num_computed_tokens >= s.num_prompt_tokens]
        batch = sched.schedule()
        assert not batch.is_empty, "scheduler stalled with work pending"
        check_batch(cfg, batch, running_decodes)
        sampled = ex.execute(batch)
        sched.update(batch, sampled)
        for seq in batch.seqs:  # the engine's stop rule
            if not seq.is_finished and seq.output_token_ids and seq.output_token_ids[-1] == EOS:
                sched.finish(seq, "stop")
        live = [s for g in groups for s in g if not s.is_finished]
        if abort_rng is not None and live and abort_rng.random() < 0.1:
            sched.abort(live[abort_rng.integers(len(live))].seq_id)
        sched.kv.check_invariants()
        if sched.tier is not None:
            sched.tier.check_invariants()
        batches += 1
        assert batches < max_steps, "no progress"
    while sched.tier is not None and sched.tier.busy:  # copies still held back: they land, their pins go
        sched.tier.wait_oldest(sched.kv)
    assert sched.kv.num_free_pages == cfg.num_pages and not sched.kv.owners and not sched.kv.cpu_tables
    assert not sched.kv.pins
    return {i: [s.output_token_ids for s in g] for i, g in enumerate(groups)}, sched, batches


def check_batch(cfg, batch, running_decodes):
    assert batch.num_tokens <= cfg.max_num_batched_tokens
    assert len(batch.seqs) <= cfg.max_num_seqs and len({id(s) for s in batch.seqs}) == len(batch.seqs)
    for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.sample):
        assert 1 <= n <= cfg.max_prefill_chunk and seq.num_computed_tokens + n <= seq.num_tokens
        assert sample == (seq.num_computed_tokens + n == seq.num_tokens)
        assert len(seq.block_table) == -(-(seq.num_computed_tokens + n) // cfg.page_size)
    # decodes first: a prefill token is scheduled only if every decode running before the step was
    # scheduled or preempted, or the batch is full
    if any(s.num_computed_tokens < s.num_prompt_tokens for s in batch.seqs) and len(batch.seqs) < cfg.max_num_seqs:
        for s in running_decodes:
            assert s in batch.seqs or s.status is not SequenceStatus.RUNNING, "a decode was skipped for a prefill"


def expected(requests):
    out = {}
    for i, (prompt, params, _) in enumerate(requests):
        seeds = [params.seed] + [None if params.seed is None else params.seed + k for k in range(1, params.n)]
        out[i] = [reference_output(prompt, SamplingParams(max_tokens=params.max_tokens, seed=s)) for s in seeds]
    return out


def workload(rng, num, max_prompt=40, shared_prefix=True, max_n=1):
    base = rng.integers(1, VOCAB, 24).tolist()
    reqs = []
    for _ in range(num):
        prompt = rng.integers(0, VOCAB, rng.integers(1, max_prompt + 1)).tolist()
        if shared_prefix and rng.random() < 0.5:
            prompt = base[:rng.integers(1, 25)] + prompt[:8]
        params = SamplingParams(max_tokens=int(rng.integers(1, 12)), seed=int(rng.integers(0, 100)),
                                n=int(rng.integers(1, max_n + 1)))
        reqs.append((prompt, params, int(rng.integers(0, 3))))
    return reqs


# ---- outputs equal the reference under every configuration ---------------------------------------
CONFIGS = {
    "roomy": dict(num_pages=256, page_size=16),
    "no-prefix-cache": dict(num_pages=256, page_size=16, enable_prefix_caching=False),
    "chunk-1": dict(num_pages=256, page_size=4, max_prefill_chunk=1),
    "chunk-7": dict(num_pages=256, page_size=4, max_prefill_chunk=7),
    "chunk-64": dict(num_pages=256, page_size=4, max_prefill_chunk=64, max_num_batched_tokens=512),
    "recompute-tight": dict(num_pages=14, page_size=4, preemption="recompute"),
    "swap-tight": dict(num_pages=14, page_size=4, preemption="swap", num_cpu_pages=64),
    "swap-tight-no-cache": dict(num_pages=14, page_size=4, preemption="swap", num_cpu_pages=64,
                                enable_prefix_caching=False),
    "swap-pool-too-small": dict(num_pages=14, page_size=4, preemption="swap", num_cpu_pages=3),
    "sjf": dict(num_pages=20, page_size=4, policy="sjf"),
    "priority": dict(num_pages=20, page_size=4, policy="priority", preemption="swap"),
    "prefix": dict(num_pages=20, page_size=4, policy="prefix"),
    "one-seq": dict(num_pages=64, page_size=4, max_num_seqs=1),
    "offload-tight": dict(num_pages=14, page_size=4, preemption="offload", num_offload_pages=64, offload_watermark=0),
    "offload-tier-too-small": dict(num_pages=14, page_size=4, preemption="offload", num_offload_pages=3,
                                   offload_watermark=0, offload_pages_per_step=2),
    "swap-and-tier-tight": dict(num_pages=14, page_size=4, preemption="swap", num_cpu_pages=64,
                                num_offload_pages=16, offload_watermark=0.3),
    "compact": dict(num_pages=40, page_size=2, compact_threshold=0.1, compact_min_holes=1, enable_prefix_caching=False),
    "compact-cached": dict(num_pages=40, page_size=2, compact_threshold=0.05, compact_min_holes=1),
    "compact-offload-tight": dict(num_pages=28, page_size=2, preemption="offload", num_offload_pages=64,
                                  offload_watermark=0.5, compact_threshold=0.1, compact_min_holes=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generation_matches_one_at_a_time_reference(name, rng):
    reqs = workload(rng, 24, max_n=3)
    cfg = SchedulerConfig(**{"max_num_batched_tokens": 32, **CONFIGS[name]})
    got, sched, _ = run(cfg, reqs)
    assert got == expected(reqs)
    if "tight" in name or "small" in name:
        assert sched.num_preemptions > 0, "the tight config should have preempted"
    if cfg.preemption in ("recompute", "offload"):
        assert sched.num_swap_outs == 0
    elif name == "swap-pool-too-small":
        assert 0 < sched.num_swap_outs < sched.num_preemptions, "expected both swaps and recompute fallbacks"
    else:
        assert sched.num_swap_outs == sched.num_preemptions
    if cfg.enable_prefix_caching and name == "roomy":
        assert sched.kv.prefix_hit_tokens > 0
    st = sched.stats()
    if name.startswith("offload-tight") or name == "compact-offload-tight":
        assert st["pages_offloaded"] > 0
        assert st["pages_restored"] > 0 and st["prefix_hits_cpu"] > 0
    if name == "offload-tier-too-small":
        assert st["offload_pages_evicted"] > 0 and st["recomputed_tokens"] > 0
    if name.startswith("compact"):
        assert st["num_compactions"] > 0 and st["pages_compacted"] > 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), budget=st.integers(1, 40), max_seqs=st.integers(1, 6),
       chunk=st.integers(1, 20), policy=st.sampled_from(["fcfs", "sjf", "priority", "prefix"]),
       preemption=st.sampled_from(["recompute", "swap", "offload"]), page_size=st.sampled_from([1, 2, 4, 8]),
       num_pages=st.integers(6, 24), num_cpu_pages=st.integers(0, 24), caching=st.booleans(),
       num_offload_pages=st.integers(0, 24), watermark=st.sampled_from([0.0, 0.5, 1.0]),
       compact=st.sampled_from([None, 0.1, 0.5]))
def test_random_workloads_finish_and_match_reference(seed, budget, max_seqs, chunk, policy, preemption, page_size,
                                                     num_pages, num_cpu_pages, caching, num_offload_pages, watermark,
                                                     compact):
    if preemption == "offload":
        num_offload_pages = max(1, num_offload_pages)
    if not caching:  # the tier keys pages by the prefix cache's hashes
        num_offload_pages, preemption = 0, "recompute" if preemption == "offload" else preemption
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_prefill_chunk=chunk,
                          policy=policy, preemption=preemption, num_pages=num_pages, num_cpu_pages=num_cpu_pages,
                          page_size=page_size, enable_prefix_caching=caching, num_offload_pages=num_offload_pages,
                          offload_watermark=watermark, offload_pages_per_step=4, compact_threshold=compact,
                          compact_min_holes=1)
    rng = np.random.default_rng(seed)
    reqs = [r for r in workload(rng, int(rng.integers(1, 10)), max_prompt=20, max_n=2)
            if len(r[0]) + r[1].max_tokens - 1 <= cfg.max_model_len]
    got, _, _ = run(cfg, reqs, abort_rng=rng)
    want = expected(reqs)
    for i in want:  # aborted sequences stop early; everything generated must still be right
        for out, ref in zip(got[i], want[i]):
            assert out == ref[:len(out)]


# ---- individual behaviours ----------------------------------------------------------------------
def seq(i, n_prompt, max_tokens=4, priority=0, arrival=None, tokens=None):
    toks = tokens if tokens is not None else [(i * 7 + k) % VOCAB + 1 for k in range(n_prompt)]
    s = Sequence(i, toks, len(toks), SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority)
    if arrival is not None:
        s.arrival_time = arrival
    return s


def step(sched, ex):
    batch = sched.schedule()
    return batch, sched.update(batch, ex.execute(batch))


def test_budget_and_decodes_first():
    cfg = SchedulerConfig(max_num_batched_tokens=10, max_prefill_chunk=8, num_pages=64, page_size=4)
    sched, ex = Scheduler(cfg), FakeExecutor(cfg)
    for i in range(3):
        sched.add(seq(i, 2, max_tokens=10, arrival=i))
    step(sched, ex)                                   # three short prompts prefill together
    sched.add(seq(9, 30, arrival=9))
    batch, _ = step(sched, ex)
    assert [s.seq_id for s in batch.seqs] == [0, 1, 2, 9] and batch.num_new_tokens == [1, 1, 1, 7]
    batch, _ = step(sched, ex)
    assert batch.num_new_tokens == [1, 1, 1, 7]       # the long prompt keeps chunking behind decodes


def test_priority_admits_important_first_and_preempts_least_important():
    cfg = SchedulerConfig(policy="priority", max_num_batched_tokens=64, num_pages=6, page_size=4)
    sched, ex = Scheduler(cfg), FakeExecutor(cfg)
    low, high = seq(0, 8, max_tokens=9, priority=5, arrival=0), seq(1, 8, max_tokens=9, priority=0, arrival=1)
    sched.add(low)
    sched.add(high)
    batch, _ = step(sched, ex)
    assert [s.seq_id for s in batch.seqs] == [1, 0]
    while not sched.num_preemptions:
        step(sched, ex)
    assert low.status is SequenceStatus.WAITING and low.num_preemptions == 1 and high.num_preemptions == 0


def test_sjf_prefers_shortest_remaining_prompt():
    cfg = SchedulerConfig(policy="sjf", max_num_batched_tokens=5, max_num_seqs=1, num_pages=64, page_size=4)
    sched = Scheduler(cfg)
    for i, n in enumerate([12, 3, 7]):
        sched.add(seq(i, n, arrival=i))
    assert [s.seq_id for s in sched.schedule().seqs] == [1]


def test_prefix_policy_groups_requests_and_defers_followers_to_hit_the_cache():
    cfg = SchedulerConfig(policy="prefix", max_num_batched_tokens=64, num_pages=64, page_size=4)
    sched, ex = Scheduler(cfg), FakeExecutor(cfg)
    shared = [3, 1, 4, 1, 5, 9, 2, 6]
    sched.add(seq(0, 0, tokens=shared + [1], arrival=0))
    sched.add(seq(1, 0, tokens=[2] * 9, arrival=1))
    sched.add(seq(2, 0, tokens=shared + [2], arrival=2))
    assert [s.seq_id for s in sched.ordered_waiting()] == [0, 2, 1]
    batch, _ = step(sched, ex)
    assert [s.seq_id for s in batch.seqs] == [0, 1]   # 2 waits for 0's prefix
    batch, _ = step(sched, ex)
    follower = next(s for s in batch.seqs if s.seq_id == 2)
    assert follower.num_cached_tokens == 8


def test_swap_preemption_round_trips_and_falls_back_to_recompute():
    for cpu_pages, mode in ((64, SequenceStatus.SWAPPED), (0, SequenceStatus.WAITING)):
        cfg = SchedulerConfig(preemption="swap", num_cpu_pages=cpu_pages, max_num_batched_tokens=64,
                              num_pages=5, page_size=4)
        sched, ex = Scheduler(cfg), FakeExecutor(cfg)
        a, b = seq(0, 8, max_tokens=9, arrival=0), seq(1, 8, max_tokens=9, arrival=1)
        sched.add(a)
        sched.add(b)
        swapped_out = False
        while not sched.num_preemptions:
            batch, _ = step(sched, ex)
            swapped_out |= bool(batch.swap_out)
        assert b.status is mode and swapped_out == (cpu_pages > 0)
        while sched.has_unfinished():
            step(sched, ex)
        assert a.output_token_ids == reference_output(a.prompt_token_ids, a.params)
        assert b.output_token_ids == reference_output(b.prompt_token_ids, b.params)


def test_swapped_sequences_return_before_new_prefills():
    cfg = SchedulerConfig(preemption="swap", num_cpu_pages=8, max_num_batched_tokens=64, num_pages=4, page_size=4)
    sched, ex = Scheduler(cfg), FakeExecutor(cfg)
    a, b, c = seq(0, 8, max_tokens=9, arrival=0), seq(1, 8, max_tokens=9, arrival=1), seq(2, 1, arrival=2)
    sched.add(a)
    sched.add(b)
    while not sched.num_preemptions:
        step(sched, ex)
    sched.add(c)                                     # fits in the free page, but b was there first
    assert b.status is SequenceStatus.SWAPPED and sched.kv.num_free_pages == 1
    while b.status is SequenceStatus.SWAPPED:
        assert c.status is SequenceStatus.WAITING
        step(sched, ex)
    while sched.has_unfinished():
        step(sched, ex)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, b.params)


def test_fork_children_share_prompt_pages_copy_on_write():
    cfg = SchedulerConfig(num_pages=32, page_size=4)
    sched, ex = Scheduler(cfg), FakeExecutor(cfg)
    parent = Sequence(0, [1, 2, 3, 4, 5, 1], 6, SamplingParams(max_tokens=3, seed=5, n=3, ignore_eos=True))
    sched.add(parent)
    children = sched.fork(parent, 3, [10, 11])
    assert [c.params.seed for c in children] == [6, 7] and all(c.parent_id == 0 for c in children)
    step(sched, ex)                                  # parent's prompt; children released onto its pages
    assert all(c.block_table == parent.block_table[:2] for c in children)
    batch, _ = step(sched, ex)
    assert len(batch.copies) == 2                    # each child copies the shared partial page
    assert {c.block_table[0] for c in children} == {parent.block_table[0]}
    while sched.has_unfinished():
        step(sched, ex)
    for s in [parent, *children]:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params)


def test_abort_and_finish_free_everything():
    cfg = SchedulerConfig(num_pages=16, page_size=4, preemption="swap")
    sched, ex = Scheduler(cfg), FakeExecutor(cfg)
    seqs = [seq(i, 6, max_tokens=20, arrival=i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    children = sched.fork(seqs[0], 2, [99])
    step(sched, ex)
    step(sched, ex)
    assert sched.abort(seqs[1].seq_id) is seqs[1] and seqs[1].finish_reason == "abort"
    assert sched.abort(12345) is None
    for s in seqs + children:
        sched.finish(s)
    assert not sched.has_unfinished() and sched.kv.num_free_pages == cfg.num_pages
    sched.kv.check_invariants()


def test_compact_batch_packs_pages_and_keeps_content():
    cfg = SchedulerConfig(num_pages=16, page_size=2, enable_prefix_caching=False)
    sched, ex = Scheduler(cfg), FakeExecutor(cfg)
    seqs = [seq(i, 5, max_tokens=8, arrival=i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    step(sched, ex)
    sched.finish(seqs[0])
    batch = sched.compact()
    assert batch.moves and not batch.seqs and not batch.copies
    ex.execute(batch)
    assert sorted(p for s in seqs[1:] for p in s.block_table) == list(range(6))
    while sched.has_unfinished():
        step(sched, ex)                             # the fake executor re-reads every slot
    sched.kv.check_invariants()


# ---- errors -------------------------------------------------------------------------------------
def test_add_rejects_what_can_never_fit():
    sched = Scheduler(SchedulerConfig(num_pages=4, page_size=4))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(Sequence(0, [1] * 10, 10, SamplingParams(max_tokens=8)))
    sched.add(Sequence(1, [1] * 10, 10, SamplingParams(max_tokens=7)))  # 16 cached tokens: fits exactly
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Sequence(1, [1], 1, SamplingParams()))


def test_update_without_a_needed_sample_is_an_error():
    cfg = SchedulerConfig()
    sched = Scheduler(cfg)
    sched.add(seq(0, 3))
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(sched.schedule(), {})


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_prefill_chunk=0), "max_prefill_chunk"), (dict(policy="lifo"), "policy"),
    (dict(preemption="drop"), "preemption"), (dict(num_pages=0), "num_pages"), (dict(page_size=0), "page_size"),
    (dict(num_cpu_pages=-1), "num_cpu_pages"), (dict(max_model_len=10**9), "max_model_len")])
def test_bad_config_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(seed=1.5), "seed"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(n=0), "n")])
def test_bad_sampling_params_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sequence_basics():
    s = Sequence(0, [5, 6], 2, SamplingParams(stop="x"))
    s.append_token(7)
    assert (s.num_tokens, s.output_token_ids, s.num_output_tokens, s.params.stop) == (3, [7], 1, ["x"])
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        Sequence(1, [], 0, SamplingParams())


# ---- KV eviction ------------------------------------------------------------------------------------
class EvictingExecutor(FakeExecutor):
    """FakeExecutor with KV eviction: a scored sequence keeps its sink and recent slots and random others (one choice
    for every layer and head here), the gather moves their fake values, and every attention read checks that the
    cache holds exactly the kept positions followed by the new ones."""

    def __init__(self, cfg: SchedulerConfig, rng):
        super().__init__(cfg)
        self.cfg, self.rng = cfg, rng
        self.cached: dict[int, list[int]] = {}  # seq_id -> the token position each cache slot holds
        self.choice: dict[int, list[int]] = {}  # seq_id -> cache slots the last scores kept

    def execute(self, batch: ScheduledBatch) -> dict[int, int]:
        P = self.P
        for ev in batch.evictions:  # first: the old pages are read before anything reuses them
            keep = self.choice[ev.seq_id]
            assert len(keep) == ev.keep and not set(ev.old_pages) & set(ev.new_pages)
            vals = [self.dev[ev.old_pages[c // P], c % P] for c in keep]
            for t, v in enumerate(vals):
                self.dev[ev.new_pages[t // P], t % P] = v
            self.cached[ev.seq_id] = [self.cached[ev.seq_id][c] for c in keep]
        self.choice.clear()
        assert not (batch.evictions and batch.moves)
        for d, c in batch.swap_out:
            self.cpu[c] = self.dev[d]
        for c, d in batch.swap_in:
            self.dev[d] = self.cpu[c]
        if batch.copies:
            src, dst = np.array(batch.copies).T
            self.dev[dst] = self.dev[src]
        if batch.moves:
            src, dst = np.array(batch.moves).T
            self.dev[dst] = self.dev[src]
        sampled = {}
        for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.sample):
            held = self.cached.get(seq.seq_id, []) if seq.num_evicted else list(range(seq.num_computed_tokens))
            assert len(held) == seq.kv_len
            new = list(range(seq.num_computed_tokens, seq.num_computed_tokens + n))
            for p in new:
                c = p - seq.num_evicted
                self.dev[seq.block_table[c // P], c % P] = slot_value(seq.token_ids[:p + 1])
            held = held + new
            seen = [self.dev[seq.block_table[c // P], c % P] for c in range(len(held))]
            assert seen == [slot_value(seq.token_ids[:p + 1]) for p in held], f"seq {seq.seq_id} read bad KV"
            self.cached[seq.seq_id] = held
            if sample:
                sampled[seq.seq_id] = next_token(seq.params.seed, seen)
        c = self.cfg
        for i, keep in batch.score:
            L = len(self.cached[batch.seqs[i].seq_id])
            middle = self.rng.permutation(np.arange(c.kv_sink, L - c.kv_recent))[:keep - c.kv_sink - c.kv_recent]
            self.choice[batch.seqs[i].seq_id] = sorted([*range(c.kv_sink), *middle.tolist(), *range(L - c.kv_recent, L)])
        return sampled


def run_evicting(cfg, requests, rng, max_steps=3000):
    sched, ex = Scheduler(cfg), EvictingExecutor(cfg, rng)
    seqs = []
    for i, (prompt, params, prio) in enumerate(requests):
        s = Sequence(i, list(prompt), len(prompt), params, priority=prio)
        sched.add(s)
        seqs += [s] + (sched.fork(s, params.n, [1000 * (i + 1) + k for k in range(params.n - 1)]) if params.n > 1 else [])
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        assert not batch.is_empty
        for s in batch.seqs:
            b = s.params.budget_tokens(s.num_prompt_tokens, cfg.kv_budget)
            if s.num_evicted and b is not None:  # an evicted sequence stays within budget + slack (or was refused)
                assert s.kv_len <= b + cfg.kv_slack or sched.evictions_refused
        sched.update(batch, ex.execute(batch))
        sched.kv.check_invariants()
        steps += 1
        assert steps < max_steps
    assert sched.kv.num_free_pages == cfg.num_pages and not sched.kv.owners
    return sched, seqs


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(4))
def test_eviction_reads_exactly_the_kept_tokens(seed, preemption):
    """Random workloads with shared prefixes, forks and preemption under a budget: every read sees the kept
    positions then the new ones, pages come back, and evicted sequences stay within budget + slack."""
    rng = np.random.default_rng(seed)
    cfg = SchedulerConfig(max_num_batched_tokens=48, max_prefill_chunk=24, num_pages=40, page_size=4,
                          preemption=preemption, num_cpu_pages=40, kv_budget=0.5, kv_sink=2, kv_recent=6,
                          kv_slack=8)
    reqs = []
    for _ in range(8):
        prompt = [1, 2, 3, 4, 5, 1, 2, 3] + rng.integers(1, VOCAB + 1, size=int(rng.integers(12, 60))).tolist()
        reqs.append((prompt, SamplingParams(max_tokens=int(rng.integers(1, 30)), ignore_eos=True, seed=1,
                                            n=int(rng.integers(1, 3)), kv_budget=[None, 16, 0.3][int(rng.integers(3))]),
                     0))
    sched, _ = run_evicting(cfg, reqs, rng)
    assert sched.num_evictions > 0 and sched.evicted_tokens > 0


def test_eviction_at_prompt_end_frees_pages_and_keeps_positions():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=64, num_pages=32, page_size=4, kv_sink=2,
                          kv_recent=4, kv_slack=8)
    sched, ex = Scheduler(cfg), EvictingExecutor(cfg, np.random.default_rng(0))
    s = Sequence(0, list(range(1, 41)), 40, SamplingParams(max_tokens=20, ignore_eos=True, kv_budget=12))
    sched.add(s)
    batch, _ = step(sched, ex)
    assert batch.score == [(0, 12)] and len(s.block_table) == 10
    batch = sched.schedule()  # the gather, then the first decode: position 40 in cache slot 12
    assert [e.keep for e in batch.evictions] == [12] and s.num_evicted == 28 and s.kv_len == 12
    assert len(s.block_table) == 4 and sched.kv.num_free_pages == 32 - 4 - 10  # the old pages: read this step
    hs = host_step(batch, cfg.page_size)
    assert hs.positions.tolist() == [40] and hs.token_kv_len.tolist() == [13]
    assert hs.slot_mapping.tolist() == [s.block_table[3] * 4 + 0]
    sched.update(batch, ex.execute(batch))
    assert sched.kv.num_free_pages == 32 - 4  # ... and back in the pool once the step ran
    while not batch.score:
        batch, _ = step(sched, ex)
    assert s.kv_len == 12 + cfg.kv_slack + 1  # past budget + slack: scored again ...
    batch, _ = step(sched, ex)
    assert batch.evictions and s.kv_len == 13  # ... and back to the budget


def test_budget_below_sink_and_recent_never_evicts():
    cfg = SchedulerConfig(num_pages=32, page_size=4, kv_sink=4, kv_recent=32, kv_budget=20)
    sched, ex = Scheduler(cfg), FakeExecutor(cfg)
    sched.add(seq(0, 60, max_tokens=3))
    while sched.has_unfinished():
        batch, _ = step(sched, ex)
        assert not batch.score and not batch.evictions


def test_eviction_without_free_pages_keeps_the_full_cache():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=64, num_pages=11, page_size=4, kv_sink=2,
                          kv_recent=4, enable_prefix_caching=False)
    sched, ex = Scheduler(cfg), EvictingExecutor(cfg, np.random.default_rng(0))
    s = Sequence(0, list(range(1, 41)), 40, SamplingParams(max_tokens=3, ignore_eos=True, kv_budget=12))
    sched.add(s)
    batch, _ = step(sched, ex)
    assert batch.score and sched.kv.num_free_pages == 1  # 3 pages needed for the kept tokens
    batch, _ = step(sched, ex)
    assert not batch.evictions and s.num_evicted == 0 and sched.evictions_refused == 1
    while sched.has_unfinished():
        step(sched, ex)


def test_eviction_reads_shared_prefix_pages_and_leaves_them_cached():
    """A prefix-cache hit shares the first pages: the evicted sequence only reads them; a later request with the
    same prefix still hits the cache and reads the right values (the fake checks every read)."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=64, num_pages=40, page_size=4, kv_sink=2,
                          kv_recent=4)
    sched, ex = Scheduler(cfg), EvictingExecutor(cfg, np.random.default_rng(1))
    prefix = list(range(1, 25))
    a = Sequence(0, prefix + [30, 31], 26, SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add(a)
    step(sched, ex)
    b = Sequence(1, prefix + [40, 41, 42], 27, SamplingParams(max_tokens=4, ignore_eos=True, kv_budget=10))
    sched.add(b)
    batch, _ = step(sched, ex)
    shared = [p for p in b.block_table if p in a.block_table]
    assert len(shared) == 6 and batch.score
    batch, _ = step(sched, ex)
    assert batch.evictions and not set(b.block_table) & set(a.block_table)
    assert all(sched.kv.ref_count[p] == 1 and p in sched.kv.page_to_hash for p in shared)
    while sched.has_unfinished():
        step(sched, ex)
    c = Sequence(2, prefix + [50], 25, SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(c)
    step(sched, ex)
    assert c.num_cached_tokens == 24
    while sched.has_unfinished():
        step(sched, ex)


# ---- policies under memory pressure -------------------------------------------------------------------
def test_sjf_ranks_by_expected_remaining_work():
    cfg = SchedulerConfig(policy="sjf", max_num_batched_tokens=64, max_num_seqs=1, num_pages=64, page_size=4)
    sched = Scheduler(cfg)
    sched.add(seq(0, 3, max_tokens=100, arrival=0))  # short prompt, long answer: 103 tokens of work
    sched.add(seq(1, 10, max_tokens=2, arrival=1))   # 12
    sched.add(seq(2, 6, max_tokens=30, arrival=2))   # 36
    assert [s.seq_id for s in sched.ordered_waiting()] == [1, 2, 0]
    assert Scheduler.remaining_work(sched.waiting[0]) == 103


def test_priority_preempts_a_running_lower_priority_sequence_for_a_waiting_higher_one():
    cfg = SchedulerConfig(policy="priority", max_num_batched_tokens=64, num_pages=6, page_size=4)
    sched, ex = Scheduler(cfg), FakeExecutor(cfg)
    low = seq(0, 16, max_tokens=9, priority=5, arrival=0)
    sched.add(low)
    step(sched, ex)
    assert low.status is SequenceStatus.RUNNING and sched.kv.num_free_pages == 2  # high needs 3
    high = seq(1, 12, max_tokens=3, priority=0, arrival=1)
    sched.add(high)
    batch, _ = step(sched, ex)
    assert [s.seq_id for s in batch.seqs] == [1] and low.status is SequenceStatus.WAITING
    assert low.num_preemptions == 1 and high.num_preemptions == 0
    same = seq(2, 12, max_tokens=3, priority=5, arrival=2)  # equal priority never preempts
    sched.add(same)
    while high.status is SequenceStatus.RUNNING:
        step(sched, ex)
    assert same.num_preemptions == 0 and sched.num_preemptions == 1


def test_prefix_policy_groups_short_requests_by_length_class():
    cfg = SchedulerConfig(policy="prefix", max_num_batched_tokens=64, num_pages=64, page_size=8)
    sched = Scheduler(cfg)
    lengths = [(3, 4), (2, 100), (4, 3), (3, 120), (5, 2)]  # (prompt, max_tokens): classes 3, 7, 3, 7, 3
    for i, (n, m) in enumerate(lengths):
        sched.add(seq(i, n, max_tokens=m, arrival=i))
    assert [s.seq_id for s in sched.ordered_waiting()] == [0, 2, 4, 1, 3]
