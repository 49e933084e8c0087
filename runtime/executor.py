"""Runs one ScheduledBatch: cache moves, then the model over the step's tokens, then the logits
of the sequences that sample. The paged KV cache of all layers is one tensor
kv [num_layers, 2, num_pages, P, Hkv, D] (CopyBlocks/SwapBlocks layout), and the swap pool is a
CPU tensor of the same layout (pinned on CUDA)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kernels import KernelBackend
from .model import LlamaForCausalLM
from .scheduler import ScheduledBatch
from .sequence import Sequence


@dataclass(slots=True)
class StepInputs:
    """Per-token and per-sequence tensors of one step (the UA paged-attention metadata)."""

    input_ids: torch.Tensor     # [T] int64
    positions: torch.Tensor     # [T] int64
    token_seq: torch.Tensor     # [T] int32: which batch row each token belongs to
    token_kv_len: torch.Tensor  # [T] int32: position + 1 (causal)
    slot_mapping: torch.Tensor  # [T] int64: page * P + offset
    page_table: torch.Tensor    # [S, max_pages] int32, -1 past a sequence's pages
    sample_rows: torch.Tensor   # [N] int64: token rows whose logits are sampled
    sample_seqs: list[Sequence]


def build_step(batch: ScheduledBatch, page_size: int, device) -> StepInputs:
    ids, pos, tseq, slots, rows, sample_seqs = [], [], [], [], [], []
    num_tokens = 0
    max_pages = max(len(s.block_table) for s in batch.seqs)
    table = np.full((len(batch.seqs), max_pages), -1, dtype=np.int32)
    samples = batch.sample or [s.num_computed_tokens + n == s.num_tokens
                               for s, n in zip(batch.seqs, batch.num_new_tokens)]
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        if n < 1 or start + n > seq.num_tokens:
            raise ValueError(f"batch: sequence {seq.seq_id} schedules positions [{start}, {start + n}) "
                             f"of {seq.num_tokens} tokens")
        if len(seq.block_table) * page_size < start + n:
            raise ValueError(f"batch: sequence {seq.seq_id} has {len(seq.block_table)} pages for {start + n} tokens")
        bt = np.asarray(seq.block_table, dtype=np.int64)
        table[i, :len(bt)] = bt
        p = np.arange(start, start + n, dtype=np.int64)
        ids.append(np.asarray(seq.token_ids[start:start + n], dtype=np.int64))
        pos.append(p)
        tseq.append(np.full(n, i, dtype=np.int32))
        slots.append(bt[p // page_size] * page_size + p % page_size)
        num_tokens += n
        if samples[i]:  # the logits of a sequence's last token give its next one
            rows.append(num_tokens - 1)
            sample_seqs.append(seq)
    positions = np.concatenate(pos)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return StepInputs(t(np.concatenate(ids)), t(positions), t(np.concatenate(tseq)),
                      t((positions + 1).astype(np.int32)), t(np.concatenate(slots)), t(table),
                      t(np.asarray(rows, dtype=np.int64)), sample_seqs)


class Executor:
    def __init__(self, model: LlamaForCausalLM, kernels: KernelBackend, num_pages: int, num_cpu_pages: int,
                 page_size: int, device: str, dtype: torch.dtype):
        cfg = model.cfg
        self.model, self.kernels, self.page_size, self.device = model, kernels, page_size, device
        shape = (cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.cpu_kv = torch.zeros((*shape[:2], num_cpu_pages, *shape[3:]), dtype=dtype,
                                  pin_memory=device == "cuda" and num_cpu_pages > 0)

    def _mapping(self, pairs) -> torch.Tensor:
        return torch.tensor(pairs, dtype=torch.int64, device=self.device).reshape(-1, 2)

    def run_cache_ops(self, batch: ScheduledBatch) -> None:
        """Order matters: swap-out frees pages that swap-in and copy-on-write may reuse."""
        if batch.swap_out:
            self.kernels.swap_blocks(src=self.kv, dst=self.cpu_kv, mapping=self._mapping(batch.swap_out))
        if batch.swap_in:
            self.kernels.swap_blocks(src=self.cpu_kv, dst=self.kv, mapping=self._mapping(batch.swap_in))
        if batch.copies:
            self.kernels.copy_blocks(kv=self.kv, mapping=self._mapping(batch.copies))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Returns (sequences that sample, their next-token logits [N, V] float32)."""
        self.run_cache_ops(batch)
        if not batch.seqs:
            return [], torch.empty(0, self.model.cfg.vocab_size)
        step = build_step(batch, self.page_size, self.device)
        plan = self.kernels.plan_step(step.token_seq.shape[0], step.page_table.shape[0],
                                      step.page_table.shape[1] * self.page_size)

        def attention(layer: int, q, k, v):
            k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]
            self.kernels.reshape_and_cache(k=k, v=v, slot_mapping=step.slot_mapping, k_cache=k_cache, v_cache=v_cache)
            out = torch.empty_like(q)
            self.kernels.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache, token_seq=step.token_seq,
                                         page_table=step.page_table, token_kv_len=step.token_kv_len, out=out,
                                         plan=plan)
            return out

        hidden = self.model(step.input_ids, step.positions, attention)
        return step.sample_seqs, self.model.logits(hidden[step.sample_rows])
