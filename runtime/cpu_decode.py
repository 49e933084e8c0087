"""Single-sequence decode steps on the tvm-cpu backend, recorded once and replayed (plan once, run many).

The CPU counterpart of graphs.DecodeGraphs. The first decode step of a lone sequence runs the model's forward
(embedding, every layer's kernels, the final norm and the lm_head) over static input tensors with the backend's
tape open (TVMCPUBackend.recording); every later such step writes its token id, position, cache slot and page
table into those tensors (through numpy views of them) and replays the tape: the same kernel calls over the same
tensors, with none of the model's Python in between. The page table is num_pages wide (-1 past a sequence's
pages; attention reads a sequence's pages up to its length only), so one tape serves every length; a step whose
attention plan (plan_step) differs gets a tape of its own. The logits are the tape's tensor: each replay
overwrites them.

A model whose decode step reads under ONE_THREAD_BYTES of weights replays on one thread of TVM's pool when the
backend runs more (its kernels are microseconds long: waking the pool for each costs more than the threads win,
and on shared cores a descheduled pool thread stalls every launch); the pool's size is restored after each
replay. The threads do not change the arithmetic (a parallel loop's tasks are independent rows).

A model whose step the tape cannot hold (NotRecordable: a layer op that runs in torch at one token) or that does
not compute in float32 runs every step through the executor's ordinary path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .kernels import NotRecordable, TVMCPUBackend
from .scheduler import ScheduledBatch
from .step import StepInputs

log = logging.getLogger("uacompile.runtime")
ONE_THREAD_BYTES = 4 << 20  # models reading fewer weight bytes a decode step replay on one thread


@dataclass
class _Tape:
    plan: object           # the attention plan the tape's calls were recorded with (kept alive: tapes key on id)
    calls: list            # (function, arguments)
    logits: torch.Tensor   # [1, V] float32, written by every replay


class CpuDecodeProgram:
    def __init__(self, executor, backend: TVMCPUBackend, width: int):
        self.ex, self.backend, self.width = executor, backend, width
        self.enabled = executor.model.dtype == torch.float32
        self.input_ids = torch.zeros(1, dtype=torch.int64)
        self.positions = torch.zeros(1, dtype=torch.int64)
        self.token_seq = torch.zeros(1, dtype=torch.int32)
        self.token_kv_len = torch.ones(1, dtype=torch.int32)
        self.slot_mapping = torch.zeros(1, dtype=torch.int64)
        self.page_table = torch.full((1, width), -1, dtype=torch.int32)
        self._ids, self._pos, self._len, self._slot, self._table = (
            t.numpy() for t in (self.input_ids, self.positions, self.token_kv_len, self.slot_mapping, self.page_table))
        self._written: list[int] = []  # the block table the page table holds
        self.tapes: dict[int, _Tape] = {}  # id(plan) -> its tape
        self.plans: dict[int, object] = {}  # pages of the sequence -> the attention plan (plan_step) of its steps
        self.small = executor.model.decode_read_bytes() < ONE_THREAD_BYTES  # replays on one thread
        self.pool = None  # TVM's pool resizer (backend.threads_setter), made at the first one-thread replay

    def fits(self, batch: ScheduledBatch) -> bool:
        """One sequence computing its last token (known on the host), no cache ops (compaction moves, swaps,
        copy-on-write, offload copies: Executor.run_cache_ops runs them), the backend running the
        model's layer ops and not wrapped (a tracer's TracedKernels sees every call)."""
        if (not self.enabled or len(batch.seqs) != 1 or batch.moves or batch.swap_out or batch.swap_in or batch.copies
                or batch.offload or batch.evictions or batch.score):
            return False
        seq = batch.seqs[0]
        pos = seq.num_computed_tokens
        return (batch.num_new_tokens[0] == 1 and pos == seq.num_tokens - 1 and seq.token_ids[pos] >= 0
                and len(seq.block_table) <= self.width and self.ex.kernels is self.backend
                and self.ex.model.layer_backend is self.backend)

    def run(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The step's logits [1, V] (the tape's tensor), or None where the step cannot be recorded (the caller
        runs it the ordinary way; recording is then off for good)."""
        seq = batch.seqs[0]
        pos, P, table = seq.num_computed_tokens, self.ex.page_size, seq.block_table
        c = pos - seq.num_evicted  # its cache slot
        if table != self._written:
            self._table[0, :len(table)] = table
            self._table[0, len(table):] = -1
            self._written = list(table)
        self._ids[0] = seq.token_ids[pos]
        self._pos[0] = pos
        self._len[0] = c + 1
        self._slot[0] = table[c // P] * P + c % P
        plan = self.plans.get(len(table), self)  # (self: not planned yet; a plan may be None)
        if plan is self:
            plan = self.plans[len(table)] = self.backend.plan_step(1, 1, len(table) * P)
        tape = self.tapes.get(id(plan))
        if tape is None:
            return self._record(seq, plan)
        if not self.small or self.backend.threads == 1:
            for fn, args in tape.calls:
                fn(*args)
            return tape.logits
        self.pool = self.pool or self.backend.threads_setter()
        self.pool(1)
        try:
            for fn, args in tape.calls:
                fn(*args)
        finally:
            self.pool(self.backend.threads)
        return tape.logits

    def _record(self, seq, plan) -> torch.Tensor | None:
        step = StepInputs(self.input_ids, self.positions, self.token_seq, self.token_kv_len, self.slot_mapping,
                          self.page_table, torch.zeros(1, dtype=torch.int64), [seq])
        try:
            with self.backend.recording() as calls:
                logits = self.ex.model.logits(self.ex.forward(step, plan))
        except NotRecordable as e:
            log.info("decode steps run unrecorded: %s", e)
            self.enabled = False
            return None
        self.tapes[id(plan)] = _Tape(plan, calls, logits)
        return logits
