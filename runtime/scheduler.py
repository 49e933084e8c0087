"""Continuous batching: one rule — each sequence's computed tokens catch up with its tokens, under a
token budget, decodes first (chunked prefill falls out of it) — plus admission policies and preemption.

A step: schedule() -> executor runs batch.moves (compaction), batch.swap_out, batch.swap_in, batch.copies, launches
batch.offload on its copy engine, then the forward pass -> update(batch, sampled). Stop conditions other than
max_tokens are the engine's: it calls finish(seq, reason).

With a CPU offload tier (num_offload_pages > 0, offload.py) each step also plans copies of running sequences' full
pages into the tier, the likeliest victims first, once KV usage reaches offload_watermark; a preempted sequence's
pages are freed at once (preemption "offload" is recompute preemption with the tier behind it), and an admitted
sequence whose prefix continues in the tier past the GPU prefix cache is restored from it (RESTORING, not scheduled
until its copy is done) instead of recomputed. Compaction runs at the start of a step when fragmentation
(KVManager.fragmentation) reaches compact_threshold with at least compact_min_holes holes, and no copy is in flight.

Policies order the waiting queue: fcfs by arrival; sjf by the expected remaining work (remaining_work: prompt left
plus the outputs max_tokens allows); priority by priority (lower number first), and a waiting request that cannot
get pages preempts the least important running sequence less important than itself; prefix groups requests (each
group at its oldest member's place): those whose first page is equal (a shared cached prefix, the followers
deferred while it is computed), the others by length class (the power of two of prompt + max_tokens), so requests
of similar length run and finish together.

KV eviction within a budget (a request's SamplingParams.kv_budget, else kv_budget here): the step in which a
sequence's chunk reaches the end of its prompt with more than its budget cached, or a later step that takes its cache
past budget + kv_slack, scores its cached tokens (batch.score: the executor runs the kv_score op over a window of
the chunk's last kv_window queries, every layer, and picks per layer and KV head the kv_sink first tokens, the
kv_recent last and the top-scored rest up to the budget); the next step gathers the kept tokens into fresh pages
before anything else (batch.evictions, KVManager.evict) and frees the old ones. Fail-closed: a budget below
kv_sink + kv_recent (the recent window would be dropped) never evicts, and an eviction whose pages are not free
keeps the full cache; shared pages are only read.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace

from .kv_manager import KVManager
from .offload import OffloadPlan, OffloadTier
from .sequence import Sequence, SequenceStatus

POLICIES = ("fcfs", "sjf", "priority", "prefix")
EVICT_METHODS = ("andpro", "attention", "value_norm")  # ir.SCORE_METHODS
PREEMPTION_MODES = ("recompute", "swap", "offload")
_child_ids = itertools.count(1 << 40)
log = logging.getLogger(__name__)  # ids for forked children, far from the engine's own counter


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 256   # token budget of one step
    max_num_seqs: int = 32              # sequences running at once (and per step)
    max_prefill_chunk: int = 64         # most prompt tokens one sequence computes in one step
    policy: str = "fcfs"                # fcfs | sjf | priority | prefix
    preemption: str = "recompute"       # recompute | swap (falls back to recompute if the pool is full) | offload
    #                                     (recompute of what the offload tier does not hold; needs num_offload_pages)
    num_pages: int = 512
    num_cpu_pages: int = 256            # the swap pool
    page_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int | None = None    # default: whatever num_pages can hold
    num_offload_pages: int = 0          # the CPU offload tier's pages (0: no tier)
    offload_watermark: float = 0.5      # KV usage from which running sequences' pages are saved to the tier
    offload_pages_per_step: int = 64    # most pages a step saves
    compact_threshold: float | None = 0.5  # fragmentation that triggers compaction (None: never)
    compact_min_holes: int = 64         # ... with at least this many holes
    kv_budget: int | float | None = None  # KV eviction default for requests that set none (SamplingParams.kv_budget)
    kv_evict_method: str = "andpro"     # andpro | attention | value_norm: the kv_score op's method
    kv_sink: int = 4                    # first tokens eviction always keeps (attention sinks)
    kv_recent: int = 32                 # last tokens eviction always keeps
    kv_window: int = 32                 # observation window: the last queries of the chunk that scores
    kv_slack: int = 64                  # a decoding sequence is evicted again past budget + slack tokens

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_prefill_chunk", "num_pages", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.num_cpu_pages, int) or isinstance(self.num_cpu_pages, bool) or self.num_cpu_pages < 0:
            raise ValueError(f"num_cpu_pages must be an int >= 0, got {self.num_cpu_pages!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        for name, lo in (("num_offload_pages", 0), ("offload_pages_per_step", 1), ("compact_min_holes", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if self.num_offload_pages and not self.enable_prefix_caching:
            raise ValueError("the CPU offload tier (num_offload_pages > 0) keys pages by the prefix cache's hashes: "
                             "it needs enable_prefix_caching=True")
        if self.preemption == "offload" and not self.num_offload_pages:
            raise ValueError("preemption='offload' needs a CPU offload tier: num_offload_pages > 0 "
                             "(EngineConfig.cpu_offload_bytes)")
        w = self.offload_watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1:
            raise ValueError(f"offload_watermark must be a number in [0, 1], got {w!r}")
        t = self.compact_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1):
            raise ValueError(f"compact_threshold must be a number in (0, 1] or None, got {t!r}")
        b = self.kv_budget
        if b is not None and not ((isinstance(b, int) and not isinstance(b, bool) and b >= 1)
                                  or (isinstance(b, float) and 0 < b <= 1)):
            raise ValueError(f"kv_budget must be an int >= 1 (tokens), a float in (0, 1] (a share of the prompt) "
                             f"or None, got {b!r}")
        if self.kv_evict_method not in EVICT_METHODS:
            raise ValueError(f"kv_evict_method must be one of {EVICT_METHODS}, got {self.kv_evict_method!r}")
        for name, lo in (("kv_sink", 0), ("kv_recent", 1), ("kv_window", 1), ("kv_slack", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        capacity = self.num_pages * self.page_size
        if self.max_model_len is None:
            self.max_model_len = capacity
        elif not isinstance(self.max_model_len, int) or not 1 <= self.max_model_len <= capacity:
            raise ValueError(f"max_model_len must be in [1, num_pages * page_size = {capacity}], "
                             f"got {self.max_model_len!r}")


@dataclass
class Eviction:
    """A sequence's kept tokens moving into fresh pages: the executor gathers the `keep` tokens its last scores chose
    (per layer and KV head) from old_pages into new_pages, slots 0 .. keep - 1."""

    seq_id: int
    old_pages: list[int]
    new_pages: list[int]
    keep: int


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # seq i computes positions
    # [seq.num_computed_tokens, + num_new_tokens[i]) this step
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device page, cpu page)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu page, device page)
    copies: list[tuple[int, int]] = field(default_factory=list)    # (src page, dst page)
    sample: list[bool] = field(default_factory=list)  # seq i reaches its last token: sample one
    moves: list[tuple[int, int]] = field(default_factory=list)     # compaction (src page, dst page), run first
    offload: OffloadPlan = field(default_factory=OffloadPlan)      # copies to and from the CPU offload tier
    evictions: list[Eviction] = field(default_factory=list)        # kept tokens gathered first (after moves)
    score: list[tuple[int, int]] = field(default_factory=list)     # (row i, budget): score seqs[i]'s cache

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.swap_out or self.swap_in or self.copies or self.moves or self.offload
                    or self.evictions)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = KVManager(config.num_pages, config.page_size, config.num_cpu_pages, config.enable_prefix_caching)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.restoring: list[Sequence] = []  # admitted, their prefix on its way from the offload tier
        self.parked: dict[int, list[Sequence]] = {}  # parent seq_id -> children waiting for its prompt
        self.tier = OffloadTier(config.num_offload_pages) if config.num_offload_pages else None
        self.num_preemptions = 0
        self.num_swap_outs = 0  # preemptions that went to the CPU pool (the rest recomputed)
        self.num_compactions = 0
        self.fragmentation = (0.0, 0)  # KVManager.fragmentation() when compaction last looked
        self.pages_compacted = 0
        self.recomputed_tokens = 0  # tokens computed again after a recompute preemption
        self.lost: dict[int, int] = {}  # seq_id -> tokens it had computed when preempted by recompute
        self.to_evict: list[tuple[Sequence, int]] = []  # scored in the last step: (sequence, tokens to keep)
        self.num_evictions = 0
        self.evicted_tokens = 0
        self.evictions_refused = 0  # evictions that kept the full cache (pages short)

    # ---- requests -------------------------------------------------------------------------------
    def _all(self):
        return itertools.chain(self.waiting, self.running, self.swapped, self.restoring, *self.parked.values())

    def add(self, seq: Sequence) -> None:
        """Queue a new request; ValueError if it could never run to max_tokens."""
        c = self.config
        longest = seq.num_prompt_tokens + seq.params.max_tokens - 1  # the last sampled token is never cached
        if longest > c.max_model_len:
            raise ValueError(f"request {seq.seq_id}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                             f"({seq.params.max_tokens}) needs {longest + 1} tokens of context, more than "
                             f"max_model_len={c.max_model_len}")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"request {seq.seq_id}: only a fresh WAITING sequence can be added")
        if any(s.seq_id == seq.seq_id for s in self._all()):
            raise ValueError(f"request {seq.seq_id}: seq_id already in use")
        self.waiting.append(seq)

    def fork(self, seq: Sequence, n: int, child_ids: list[int] | None = None) -> list[Sequence]:
        """n-way sampling: returns n - 1 children (seq is sample 0). Call it right after add(seq).
        Children wait until seq's prompt is computed, then share its pages copy-on-write and each
        recompute the last prompt token to draw its own first sample. A seeded parent's children
        get seeds seed + 1, seed + 2, ... (mod 2**64)"""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork: n must be an int >= 1, got {n!r}")
        if seq.num_output_tokens or seq.status is SequenceStatus.FINISHED:
            raise ValueError(f"fork: sequence {seq.seq_id} already produced output; fork it before it runs")
        if child_ids is not None and len(child_ids) != n - 1:
            raise ValueError(f"fork: child_ids must hold n - 1 = {n - 1} ids, got {len(child_ids)}")
        ids = child_ids or [next(_child_ids) for _ in range(n - 1)]
        children = []
        for i, cid in enumerate(ids, 1):
            params = replace(seq.params, n=1, seed=None if seq.params.seed is None else (seq.params.seed + i) % 2**64)
            children.append(Sequence(cid, seq.prompt_token_ids, seq.num_prompt_tokens, params, seq.priority,
                                     seq.arrival_time, parent_id=seq.seq_id))
        self.parked.setdefault(seq.seq_id, []).extend(children)  # update() releases them
        return children

    def _adopt_prompt(self, parent: Sequence, child: Sequence) -> None:
        if (parent.status is SequenceStatus.RUNNING and parent.num_computed_tokens >= child.num_prompt_tokens
                and not parent.num_evicted):
            self.kv.fork(parent, child, self.kv.pages_for(child.num_prompt_tokens))
            child.num_computed_tokens = child.num_prompt_tokens - 1
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:  # parent gone: the child computes its own prompt
            self.waiting.append(child)

    def finish(self, seq: Sequence, reason: str = "stop") -> None:
        if seq.status is SequenceStatus.FINISHED:
            return
        for queue in (self.waiting, self.running, self.swapped, self.restoring):
            if seq in queue:
                queue.remove(seq)
        self.lost.pop(seq.seq_id, None)
        if self.tier is not None:
            self.tier.forget(seq.seq_id)
        for children in self.parked.values():
            if seq in children:
                children.remove(seq)
        for child in self.parked.pop(seq.seq_id, []):
            self.waiting.append(child)
        self.kv.release(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def abort(self, seq_id: int) -> Sequence | None:
        seq = next((s for s in self._all() if s.seq_id == seq_id), None)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.restoring or any(self.parked.values()))

    # ---- ordering -------------------------------------------------------------------------------
    @staticmethod
    def remaining_work(seq: Sequence) -> int:
        """SJF's rank: the tokens a sequence still has to compute, prompt left plus the outputs max_tokens allows."""
        return seq.num_tokens - seq.num_computed_tokens + seq.params.max_tokens - seq.num_output_tokens

    def _key(self, seq: Sequence):
        if self.config.policy == "sjf":
            return (self.remaining_work(seq), seq.arrival_time, seq.seq_id)
        if self.config.policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def ordered_waiting(self) -> list[Sequence]:
        seqs = sorted(self.waiting, key=self._key)
        if self.config.policy != "prefix":
            return seqs
        # prefix-aware: requests whose first page is equal go together, the group at its oldest member
        first = {}
        for s in seqs:
            first.setdefault(self._group(s), self._key(s))
        return sorted(seqs, key=lambda s: (first[self._group(s)], not self._shares_prefix(self._group(s)), self._key(s)))

    def _group(self, seq: Sequence):
        """The prefix policy's group: requests whose first page is equal share a cached prefix; the others group
        by length class, the power of two of prompt + max_tokens (a bucket per class), so requests of similar
        length run together and finish together instead of one long request holding pages that preempt the rest."""
        P = self.config.page_size
        if seq.num_prompt_tokens > P:
            return tuple(seq.token_ids[:P])
        return ("length", (seq.num_prompt_tokens + seq.params.max_tokens).bit_length())

    @staticmethod
    def _shares_prefix(group) -> bool:
        return group is not None and group[:1] != ("length",)

    @staticmethod
    def _victim_key(seq: Sequence):
        return (seq.priority, seq.arrival_time, seq.seq_id)

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """Least important first: lowest priority (largest number), then latest arrival."""
        return max(candidates, key=self._victim_key)

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        c, kv, batch = self.config, self.kv, ScheduledBatch()
        kv.end_step()  # the previous step ran (idempotent: update() already said so)
        budget = c.max_num_batched_tokens
        if self.tier is not None:
            self._restored(self.tier.poll(kv))
        batch.evictions = self._plan_evictions()
        batch.moves = [] if batch.evictions else self._maybe_compact()  # compaction would rename the old pages
        restoring = []  # sequences this step starts restoring

        def take(seq, num_new, copies):
            nonlocal budget
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.sample.append(seq.num_computed_tokens + num_new == seq.num_tokens)
            batch.copies.extend(copies)
            budget -= num_new
            keep = self._eviction_budget(seq, num_new)
            if keep is not None:
                batch.score.append((len(batch.seqs) - 1, keep))

        room_made = self._make_room_for_priority(batch)

        # 1. running sequences, decodes first
        decode_first = sorted(self.running, key=lambda s: (s.num_computed_tokens < s.num_prompt_tokens,
                                                           self._key(s)))
        preempted = False
        for seq in decode_first:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            if budget == 0 or len(batch.seqs) >= c.max_num_seqs:
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, c.max_prefill_chunk)
            while (copies := kv.allocate_slots(seq, num_new)) is None:
                victim = self._victim([s for s in self.running if s not in batch.seqs])
                self._preempt(victim, batch)
                preempted = True
                if victim is seq:
                    break
            if copies is not None:
                take(seq, num_new, copies)

        # 2. swapped sequences come back before any new prefill
        while self.swapped and not preempted and not room_made and budget and self._num_active() < c.max_num_seqs:
            seq = min(self.swapped, key=self._key)
            mapping = kv.swap_in(seq)
            if mapping is None:
                break
            self.swapped.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.swap_in.extend(mapping)
            log.info("swapped sequence %d back in: %d pages", seq.seq_id, len(mapping))
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, c.max_prefill_chunk)
            if len(batch.seqs) < c.max_num_seqs and (copies := kv.allocate_slots(seq, num_new)) is not None:
                take(seq, num_new, copies)

        # 3. new (or recompute-preempted) requests
        if self.waiting and (not self.swapped or room_made) and not preempted:
            prefilling = {self._group(s) for s in self.running if s.num_computed_tokens < s.num_prompt_tokens}
            for seq in self.ordered_waiting():
                if budget == 0 or self._num_active() >= c.max_num_seqs or len(batch.seqs) >= c.max_num_seqs:
                    break
                group = self._group(seq)
                if c.policy == "prefix" and self._shares_prefix(group) and group in prefilling:
                    continue  # its shared prefix is being computed: join next step and hit the cache
                # a request for prompt log-probabilities computes its whole prompt: no cached prefix
                prefix = kv.match_prefix(seq) if seq.params.prompt_logprobs is None else []
                from_tier = self._tier_match(seq, len(prefix)) if seq.params.prompt_logprobs is None else []
                if from_tier:  # the prefix continues in the offload tier: restore it, compute nothing yet
                    if kv.allocate_slots(seq, len(from_tier) * c.page_size, prefix) is None:
                        break
                    self.tier.plan_restore(kv, from_tier, seq.block_table[len(prefix):], batch.offload)
                    self._admitted(seq, len(prefix) * c.page_size, len(from_tier) * c.page_size)
                    seq.status = SequenceStatus.RESTORING
                    self.restoring.append(seq)
                    restoring.append(seq)
                    log.info("restoring sequence %d: %d pages from the offload tier", seq.seq_id, len(from_tier))
                    continue
                num_cached = len(prefix) * c.page_size
                num_new = min(seq.num_tokens - num_cached, budget, c.max_prefill_chunk)
                copies = kv.allocate_slots(seq, num_new, prefix)
                if copies is None:
                    break  # head of line waits for pages; later arrivals do not jump it
                self._admitted(seq, num_cached, 0)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                prefilling.add(group)
                take(seq, num_new, copies)

        # 4. the offload tier: save the likeliest victims' pages ahead of memory pressure
        if self.tier is not None:
            saved = []
            if kv.usage >= c.offload_watermark:
                order = sorted(self.running, key=self._victim_key, reverse=True)
                saved = self.tier.plan_saves(kv, order, c.offload_pages_per_step, batch.offload)
            self.tier.launched(batch.offload, saved, restoring)
            if batch.is_empty and self.tier.busy and self.has_unfinished():
                # nothing runs until copies land (a restore, or saves whose pins hold the pages): wait for them
                self._restored(self.tier.wait_oldest(kv))
                return self.schedule()
        return batch

    def _eviction_budget(self, seq: Sequence, num_new: int) -> int | None:
        """The tokens seq keeps if this step's chunk should score its cache, else None: the chunk reaches the end
        of the prompt with more than the budget cached, or takes the cache past budget + kv_slack. A budget below
        kv_sink + kv_recent would drop the recent window: never."""
        c = self.config
        b = seq.params.budget_tokens(seq.num_prompt_tokens, c.kv_budget)
        if b is None or b < c.kv_sink + c.kv_recent:
            return None
        after = seq.kv_len + num_new
        ends_prompt = seq.num_computed_tokens < seq.num_prompt_tokens <= seq.num_computed_tokens + num_new
        return b if after > b + (0 if ends_prompt else c.kv_slack) else None

    def _plan_evictions(self) -> list[Eviction]:
        """The evictions the last step scored, for sequences still running (KVManager.evict; pages short: the
        sequence keeps its full cache)."""
        plans, todo, self.to_evict = [], self.to_evict, []
        for seq, keep in todo:
            if seq.status is not SequenceStatus.RUNNING or keep >= seq.kv_len:
                continue
            before = seq.kv_len
            pages = self.kv.evict(seq, keep)
            if pages is None:
                self.evictions_refused += 1
                log.info("eviction of sequence %d skipped: %d pages for its %d kept tokens are not free; it keeps "
                         "its full cache", seq.seq_id, self.kv.pages_for(keep), keep)
                continue
            plans.append(Eviction(seq.seq_id, pages[0], pages[1], keep))
            self.num_evictions += 1
            self.evicted_tokens += before - keep
            log.debug("evicting sequence %d: %d of %d cached tokens kept, %d -> %d pages", seq.seq_id, keep, before,
                      len(pages[0]), len(pages[1]))
        return plans

    def _make_room_for_priority(self, batch: ScheduledBatch) -> bool:
        """priority: while the most important waiting request would not get pages for its first chunk (beside a
        page for each running decode that fills its last one), preempt the least important running sequence less
        important than it. Returns whether it preempted."""
        c, kv = self.config, self.kv
        if c.policy != "priority" or not self.waiting:
            return False
        head = min(self.waiting, key=self._key)
        need = kv.pages_for(min(head.num_tokens, c.max_prefill_chunk, c.max_num_batched_tokens))
        need -= len(kv.match_prefix(head))
        done = False
        while True:
            decodes = sum(1 for s in self.running if s.kv_len % c.page_size == 0)
            cands = [s for s in self.running if s.priority > head.priority]
            if kv.num_free_pages >= need + decodes or not cands:
                return done
            self._preempt(self._victim(cands), batch)
            done = True

    def _num_active(self) -> int:
        return len(self.running) + len(self.restoring)

    def _tier_match(self, seq: Sequence, num_gpu_pages: int) -> list[int]:
        """Tier pages continuing seq's prefix after its num_gpu_pages pages in the GPU prefix cache."""
        if self.tier is None:
            return []
        return self.tier.match(self.kv.prefix_hashes(seq)[num_gpu_pages:])

    def _admitted(self, seq: Sequence, gpu_tokens: int, tier_tokens: int) -> None:
        kv = self.kv
        kv.prefix_query_tokens += seq.num_tokens
        kv.prefix_hit_tokens += gpu_tokens
        if self.tier is not None:
            self.tier.stats.hit_tokens += tier_tokens
        seq.num_computed_tokens = gpu_tokens + tier_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.recomputed_tokens += max(0, self.lost.pop(seq.seq_id, 0) - seq.num_computed_tokens)
        self.waiting.remove(seq)

    def _restored(self, seqs: list[Sequence]) -> None:
        """Restores that landed: their sequences run from the next step on (aborted ones are gone)."""
        for seq in seqs:
            if seq.status is SequenceStatus.RESTORING:
                self.restoring.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self.kv.register_full_pages(seq)

    def _maybe_compact(self) -> list[tuple[int, int]]:
        c, kv = self.config, self.kv
        if c.compact_threshold is None or (self.tier is not None and self.tier.busy) or kv.pins:
            return []
        if len(kv.free_pages) + len(kv.deferred) < c.compact_min_holes:
            return []  # too few empty pages for that many holes
        share, holes = self.fragmentation = kv.fragmentation()
        if share < c.compact_threshold or holes < c.compact_min_holes:
            return []
        moves = kv.compact()
        self.num_compactions += 1
        self.pages_compacted += len(moves)
        self.fragmentation = (0.0, 0)
        log.info("compacted the KV cache: fragmentation %.2f (%d holes), %d pages moved", share, holes, len(moves))
        return moves

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.preemption == "swap" and (mapping := self.kv.swap_out(seq)) is not None:
            batch.swap_out.extend(mapping)
            self.num_swap_outs += 1
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            log.info("preempted sequence %d by swap: %d pages to the CPU pool (%d preemptions so far)",
                     seq.seq_id, len(mapping), self.num_preemptions)
        else:
            log.info("preempted sequence %d by recompute: its %d computed tokens freed (%d preemptions so far)",
                     seq.seq_id, seq.num_computed_tokens, self.num_preemptions)
            if self.tier is not None:  # what the tier holds of it is what it comes back with: keep it longest
                self.tier.touch(self.kv.computed_page_hashes(seq))
            self.kv.free(seq)
            self.lost[seq.seq_id] = seq.num_computed_tokens
            seq.num_computed_tokens = seq.num_evicted = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)

    def update(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[Sequence]:
        """Record the step: advance computed tokens, publish full pages, append sampled tokens, finish
        sequences that hit max_tokens (reason "length"). Returns the sequences finished here."""
        self.kv.end_step()
        finished = []
        self.to_evict = [(batch.seqs[i], keep) for i, keep in batch.score]
        for seq, num_new, wants_sample in zip(batch.seqs, batch.num_new_tokens, batch.sample):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted between schedule and update
            seq.num_computed_tokens += num_new
            self.kv.register_full_pages(seq)
            if seq.num_computed_tokens >= seq.num_prompt_tokens and seq.seq_id in self.parked:
                for child in self.parked.pop(seq.seq_id):
                    self._adopt_prompt(seq, child)
            if not wants_sample:
                continue
            if seq.seq_id not in sampled:
                raise ValueError(f"update: sequence {seq.seq_id} reached its last token but has no sampled token")
            seq.append_token(sampled[seq.seq_id])
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.finish(seq, "length")
                finished.append(seq)
        if self.tier is not None:  # copies done by now give their pins back (all of them, on the CPU)
            self._restored(self.tier.poll(self.kv))
        return finished

    # ---- maintenance ----------------------------------------------------------------------------
    def compact(self) -> ScheduledBatch:
        """A batch with no tokens whose moves pack the used pages to the front of the cache (what schedule() does
        by itself past compact_threshold); nothing while copies to or from the offload tier are in flight."""
        if self.tier is not None and self.tier.busy:
            return ScheduledBatch()
        moves = self.kv.compact()
        self.num_compactions += 1
        self.pages_compacted += len(moves)
        return ScheduledBatch(moves=moves)

    def stats(self) -> dict:
        kv, tier = self.kv, self.tier.stats if self.tier is not None else None
        cpu_hits = tier.hit_tokens if tier else 0
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_swapped": len(self.swapped), "num_restoring": len(self.restoring), "kv_usage": kv.usage,
                "num_preemptions": self.num_preemptions, "num_swap_outs": self.num_swap_outs,
                "recomputed_tokens": self.recomputed_tokens,
                "prefix_hit_rate": (kv.prefix_hit_tokens + cpu_hits) / max(1, kv.prefix_query_tokens),
                "prefix_hits_gpu": kv.prefix_hit_tokens, "prefix_hits_cpu": cpu_hits,
                "pages_offloaded": tier.pages_offloaded if tier else 0,
                "pages_restored": tier.pages_restored if tier else 0,
                "offload_pages_evicted": tier.pages_evicted if tier else 0,
                "offload_pages_not_saved": tier.pages_not_saved if tier else 0,
                "offload_pages_not_ready": tier.pages_not_ready if tier else 0,
                "offload_pages_used": self.tier.num_used if tier else 0,
                "num_compactions": self.num_compactions, "pages_compacted": self.pages_compacted,
                "num_evictions": self.num_evictions, "evicted_tokens": self.evicted_tokens,
                "evictions_refused": self.evictions_refused,
                "fragmentation": self.fragmentation[0]}
