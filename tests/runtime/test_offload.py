"""offload.py: the CPU offload tier's bookkeeping (entries by hash, LRU eviction, pins for copies in flight, the
fail-closed fallbacks) and its copy engines; driven through the scheduler with a fake KV cache whose copies are held
back (HeldCopies: a copy moves the fake KV only when released, so one that has not finished is seen as such), and
through the engine on stories260K: greedy outputs identical under offload, recompute and no memory pressure, 8-bit
caches (scales in the tier) included, and a prefix evicted from the GPU cache restored from the tier. The CUDA stream
path: test_offload_gpu.py."""
import pytest

from test_scheduler import FakeExecutor, expected, run, seq, workload  # noqa: E402  (tests/runtime on sys.path)
from uacompile.models import STORIES260K
from uacompile.runtime import LLM, SamplingParams
from uacompile.runtime.kv_manager import KVManager
from uacompile.runtime.offload import DONE, OffloadPlan, OffloadTier, SyncCopies
from uacompile.runtime.scheduler import Scheduler, SchedulerConfig
from uacompile.runtime.sequence import SequenceStatus


class HeldTicket:
    def __init__(self, engine, launch, hold):
        self.engine, self.launch, self.hold, self.ran = engine, launch, hold, False

    def release(self):
        if not self.ran:
            self.launch()
            self.ran = True

    def done(self):
        if self.hold <= 0:
            self.release()
        self.hold -= 1
        return self.ran

    def wait(self):
        self.engine.waits += 1
        self.release()


class HeldCopies:
    """A copy engine whose copies run only once `hold` done() queries have said no (or when released or waited
    for): copies that have not finished when their pages are next looked at."""

    def __init__(self, hold: int = 10 ** 9):
        self.hold, self.tickets, self.waits = hold, [], 0

    def submit(self, launch):
        self.tickets.append(HeldTicket(self, launch, self.hold))
        return self.tickets[-1]

    def release_all(self):
        for t in self.tickets:
            t.release()


def evict_gpu_cache(kv):
    """Take every free and cached page with a filler sequence, then free it: the GPU prefix cache is empty."""
    filler = seq(999, 1)
    assert kv.allocate_slots(filler, kv.num_free_pages * kv.page_size) is not None
    kv.free(filler)
    assert not kv.lru


# ---- the tier's bookkeeping ---------------------------------------------------------------------
def drain(sched, ex) -> None:
    """Step until nothing is unfinished."""
    while sched.has_unfinished():
        b = sched.schedule()
        sched.update(b, ex.execute(b))


def served_once(n: int, **config):
    """A scheduler over held copies (16 pages of 4, a 16-page tier saving from the start) that has served one
    request of an n-token prompt to its end, its saves still held: (sched, ex, copies, prompt, the request)."""
    cfg = SchedulerConfig(num_pages=16, page_size=4, num_offload_pages=16, offload_watermark=0, **config)
    copies = HeldCopies()
    sched, ex = Scheduler(cfg), FakeExecutor(cfg, copies)
    prompt = [(k * 5) % 6 + 1 for k in range(n)]
    a = seq(0, n, max_tokens=2, tokens=list(prompt))
    sched.add(a)
    drain(sched, ex)
    return sched, ex, copies, prompt, a


def running_seq(kv, i, n_tokens):
    s = seq(i, n_tokens)
    assert kv.allocate_slots(s, n_tokens) == []
    s.num_computed_tokens = n_tokens
    kv.register_full_pages(s)
    return s


def test_saves_pin_the_device_pages_until_their_copy_is_done():
    kv, tier = KVManager(8, 4), OffloadTier(8)
    a = running_seq(kv, 0, 9)  # two full pages and one partial: the full ones are saved
    plan = OffloadPlan()
    saved = tier.plan_saves(kv, [a], 8, plan)
    assert [d for d, _ in plan.save] == a.block_table[:2] and len(saved) == 2
    tier.launched(plan, saved, [])
    kv.free(a)  # preempted while the copy runs: its saved pages stay held
    assert all(kv.ref_count[d] == 1 and kv.pins[d] == 1 for d, _ in plan.save)
    assert tier.match(saved) == [] and tier.stats.pages_not_ready == 1  # not ready: a lookup misses it
    kv.check_invariants()
    held = HeldCopies()
    plan.ticket = held.submit(lambda: None)
    assert tier.poll(kv) == [] and tier.busy
    held.release_all()
    tier.poll(kv)
    assert not tier.busy and not kv.pins and kv.num_free_pages == 8
    assert tier.match(saved) == [t for _, t in plan.save] and tier.stats.pages_offloaded == 2
    kv.check_invariants(), tier.check_invariants()


def test_a_full_tier_evicts_its_oldest_ready_entry_and_never_one_in_flight():
    kv, tier = KVManager(16, 2), OffloadTier(2)
    a, b = running_seq(kv, 0, 5), running_seq(kv, 1, 5)
    p1 = OffloadPlan()
    s1 = tier.plan_saves(kv, [a], 8, p1)  # a's two pages fill the tier
    tier.launched(p1, s1, [])
    p2 = OffloadPlan()
    assert tier.plan_saves(kv, [b], 8, p2) == [] and tier.stats.pages_not_saved == 1  # both in flight: fail closed
    p1.ticket = DONE
    tier.poll(kv)
    p3 = OffloadPlan()
    s3 = tier.plan_saves(kv, [b], 1, p3)  # room by evicting a's oldest page
    assert len(s3) == 1 and tier.stats.pages_evicted == 1 and s1[0] not in tier and s1[1] in tier
    p3.ticket = DONE
    tier.launched(p3, s3, [])
    tier.poll(kv)
    tier.check_invariants()


def test_touched_entries_are_evicted_last():
    kv, tier = KVManager(16, 2), OffloadTier(2)
    a = running_seq(kv, 0, 5)
    p = OffloadPlan(ticket=DONE)
    saved = tier.plan_saves(kv, [a], 8, p)
    tier.launched(p, saved, [])
    tier.poll(kv)
    tier.touch(saved[:1])  # the first page is now the most recently used
    b = running_seq(kv, 1, 3)
    q = OffloadPlan(ticket=DONE)
    tier.launched(q, tier.plan_saves(kv, [b], 8, q), [])
    assert saved[0] in tier and saved[1] not in tier


def test_a_restore_pins_its_tier_pages_against_eviction():
    kv, tier = KVManager(16, 2), OffloadTier(1)
    a = running_seq(kv, 0, 3)
    p = OffloadPlan(ticket=DONE)
    tier.launched(p, tier.plan_saves(kv, [a], 8, p), [])
    tier.poll(kv)
    (t,) = tier.match(kv.computed_page_hashes(a))
    r = OffloadPlan()
    b = seq(1, 3, tokens=list(a.token_ids))
    kv.allocate_slots(b, 2)
    tier.plan_restore(kv, [t], b.block_table[:1], r)
    tier.launched(r, [], [b])
    c = running_seq(kv, 2, 3)
    q = OffloadPlan()
    assert tier.plan_saves(kv, [c], 8, q) == [] and tier.stats.pages_not_saved == 1  # its only page is being read
    r.ticket = DONE
    assert tier.poll(kv) == [b]
    tier.check_invariants(), kv.check_invariants()


def test_the_cpu_copy_engine_runs_at_once():
    ran = []
    assert SyncCopies().submit(lambda: ran.append(1)).done() and ran == [1]
    assert not OffloadPlan() and not OffloadPlan().done()


# ---- through the scheduler: copies that have not finished ----------------------------------------
OFFLOAD = dict(num_pages=14, page_size=4, preemption="offload", num_offload_pages=64, offload_watermark=0,
               max_num_batched_tokens=32)


@pytest.mark.parametrize("hold", [0, 1, 2, 5])
def test_copies_held_back_give_the_reference_outputs(hold, rng):
    """Copies land after 0, 1, 2 or 5 looks: saved pages are read as they are then (pins kept them), restores are
    not attended before they land; the outputs are the one-at-a-time reference's."""
    reqs = workload(rng, 24, max_n=3)
    copies = HeldCopies(hold)
    got, sched, _ = run(SchedulerConfig(**OFFLOAD), reqs, copies=copies)
    assert got == expected(reqs)
    st = sched.stats()
    assert sched.num_preemptions > 0 and st["pages_offloaded"] > 0 and st["pages_restored"] > 0
    if hold >= 5:  # a lookup met a save still in flight (and fell back to recompute)
        assert st["offload_pages_not_ready"] > 0


def test_a_restore_not_finished_is_not_scheduled_and_the_step_waits_for_it():
    sched, ex, copies, prompt, a = served_once(13, max_num_batched_tokens=64, max_prefill_chunk=64)
    copies.release_all()
    sched.schedule()  # the saves land: a's three full pages are in the tier
    assert sched.tier.stats.pages_offloaded == 3
    evict_gpu_cache(sched.kv)
    b2 = seq(1, 13, max_tokens=2, tokens=list(prompt))
    sched.add(b2)
    batch = sched.schedule()
    assert b2.status is SequenceStatus.RESTORING and batch.offload.restore and not batch.seqs
    assert b2.num_computed_tokens == 12
    sched.update(batch, ex.execute(batch))
    assert b2.status is SequenceStatus.RESTORING  # its copy is held: not attended
    waits = copies.waits
    batch = sched.schedule()  # nothing else to run: the scheduler waits for the restore, then runs b2
    assert copies.waits == waits + 1 and batch.seqs == [b2] and batch.num_new_tokens == [1]
    sched.update(batch, ex.execute(batch))  # the fake executor checks every slot b2 attends
    drain(sched, ex)
    copies.release_all()
    assert b2.output_token_ids == a.output_token_ids
    assert sched.stats()["prefix_hits_cpu"] == 12 and sched.stats()["pages_restored"] == 3


def test_saves_that_finish_only_when_waited_for_lose_no_kv(rng):
    """No save lands by itself: a victim's pages stay pinned (and in the GPU prefix cache) until their copy is done,
    the scheduler waits for the copies when the pins leave nothing to run, and the outputs are the reference's."""
    cfg = SchedulerConfig(**{**OFFLOAD, "offload_pages_per_step": 64})
    copies = HeldCopies()
    reqs = workload(rng, 16)
    got, sched, _ = run(cfg, reqs, copies=copies)
    assert got == expected(reqs)
    assert sched.num_preemptions > 0 and copies.waits > 0 and sched.stats()["pages_offloaded"] > 0


def test_a_save_in_flight_keeps_its_page_in_the_gpu_prefix_cache():
    sched, ex, copies, prompt, a = served_once(9)
    assert sched.tier.busy and sched.kv.pins  # a finished; its two saves are held
    c = seq(1, 9, max_tokens=2, tokens=list(prompt))
    sched.add(c)
    evict_gpu_cache(sched.kv)  # cannot take pinned pages: they stay registered
    b = sched.schedule()
    assert c.status is SequenceStatus.RUNNING and b.num_new_tokens == [1]  # 8 tokens from the GPU cache
    sched.update(b, ex.execute(b))
    assert c.output_token_ids == a.output_token_ids[:1]
    assert sched.stats()["prefix_hits_gpu"] == 8 and sched.stats()["prefix_hits_cpu"] == 0


def test_abort_of_a_restoring_sequence_keeps_its_pages_until_the_copy_lands():
    sched, ex, copies, prompt, a = served_once(9)
    copies.release_all()
    sched.schedule()
    evict_gpu_cache(sched.kv)
    c = seq(1, 9, max_tokens=2, tokens=list(prompt))
    sched.add(c)
    batch = sched.schedule()
    ex.execute(batch)
    pages = list(c.block_table)
    sched.abort(c.seq_id)
    assert not sched.has_unfinished() and all(sched.kv.ref_count[p] == 1 for p in pages[2:])  # pinned
    sched.kv.check_invariants()
    copies.release_all()
    sched.schedule()
    assert not sched.kv.pins and sched.kv.num_free_pages == 16


# ---- through the engine on stories260K ----------------------------------------------------------
PROMPTS = ["Once upon a time", "Tom and his dog went to the park. They saw a big tree and a little bird.", [1],
           "Lily liked to", "One day", "The sun was hot and the sky was blue. Lily and Tom went to the beach"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
TIGHT = dict(page_size=4, num_pages=30, max_model_len=96)


def greedy(**kw):
    llm = LLM(STORIES260K, cpu_threads=1, **kw)
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.stats()


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_greedy_outputs_are_identical_with_offload_recompute_and_no_pressure(kv):
    roomy, _ = greedy(kv_cache_dtype=kv, page_size=4)
    recompute, rs = greedy(kv_cache_dtype=kv, **TIGHT)
    offload, os_ = greedy(kv_cache_dtype=kv, preemption="offload", num_offload_pages=128, offload_watermark=0,
                          **TIGHT)
    assert rs["num_preemptions"] > 0 and os_["num_preemptions"] > 0
    assert os_["pages_offloaded"] > 0 and os_["pages_restored"] > 0 and os_["prefix_hits_cpu"] > 0
    assert os_["recomputed_tokens"] < rs["recomputed_tokens"]
    assert recompute == roomy and offload == roomy


def test_cpu_offload_bytes_sizes_the_tier_and_async_scheduling_gives_the_same_tokens():
    from uacompile.runtime import memory

    want, _ = greedy(page_size=4)
    llm = LLM(STORIES260K, cpu_threads=1, preemption="offload", cpu_offload_bytes=1 << 20, offload_watermark=0,
              async_scheduling=True, **TIGHT)
    cfg = llm.engine.model.cfg
    pb = memory.page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, llm.engine.kv_dtype)
    assert llm.engine.scheduler.config.num_offload_pages == (1 << 20) // pb
    assert llm.engine.executor.offload_kv.shape[2] == (1 << 20) // pb
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want and llm.engine.scheduler.num_preemptions > 0


def test_a_prefix_evicted_from_the_gpu_cache_is_restored_from_the_tier():
    """Two-level prefix hits: the first request's pages are saved to the tier; other requests evict them from the
    GPU prefix cache; the same prompt again is restored from the tier (not recomputed) and gives the same tokens."""
    shared = "Once upon a time, there was a little girl named Lily. She liked to play outside in the sun."
    llm = LLM(STORIES260K, cpu_threads=1, page_size=4, num_pages=40, num_offload_pages=64, offload_watermark=0)
    eng = llm.engine
    first = llm.generate([shared], GREEDY)[0].outputs[0].token_ids
    for p in ["Tom and his dog went to the park. They saw a big tree.", "The sun was hot and the sky was blue."]:
        llm.generate([p], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    before = eng.scheduler.stats()
    again = llm.generate([shared], GREEDY)[0].outputs[0].token_ids
    st = eng.scheduler.stats()
    assert st["prefix_hits_cpu"] > before["prefix_hits_cpu"] and st["pages_restored"] > before["pages_restored"]
    assert again == first


@pytest.mark.parametrize("kw,needle", [
    (dict(preemption="offload"), "preemption='offload' needs a CPU offload tier"),
    (dict(cpu_offload_bytes=0), "cpu_offload_bytes must be an int >= 1"),
    (dict(cpu_offload_bytes=10), "cpu_offload_bytes=10 holds no KV page"),
    (dict(offload_watermark=2), "offload_watermark must be a number in [0, 1]"),
    (dict(compact_threshold=0), "compact_threshold must be a number in (0, 1] or None"),
])
def test_bad_offload_options_are_one_line_errors(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        LLM(STORIES260K, cpu_threads=1, **kw)
