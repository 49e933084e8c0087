"""Runs one ScheduledBatch: cache moves, then the model over the step's tokens, then the logits
of the sequences that sample. The paged KV cache of all layers is one tensor
kv [num_layers, 2, num_pages, P, Hkv, D] (CopyBlocks/SwapBlocks layout), and the swap pool is a
CPU tensor of the same layout (pinned on CUDA).

A step's inputs are built on the host into reused (pinned on CUDA) buffers and copied to the device
without blocking. Attention is planned once a step and run every layer. On CUDA, decode steps (one new token
a sequence) replay a CUDA graph captured at start-up for their batch-size bucket and page-table width
(graphs.py); prefill and mixed steps run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kernels import KernelBackend
from .model import LlamaForCausalLM
from .scheduler import ScheduledBatch
from .sequence import Sequence


@dataclass(slots=True)
class HostStep:
    """One step's inputs on the host (numpy), before any copy to the device."""

    input_ids: np.ndarray     # [T] int64
    positions: np.ndarray     # [T] int64
    token_seq: np.ndarray     # [T] int32: which batch row each token belongs to
    slot_mapping: np.ndarray  # [T] int64: page * P + offset
    page_table: np.ndarray    # [S, max_pages] int32, -1 past a sequence's pages
    sample_rows: np.ndarray   # [N] int64: token rows whose logits are sampled
    sample_seqs: list[Sequence]
    decode: bool              # every sequence computes exactly one token and samples it

    @property
    def token_kv_len(self) -> np.ndarray:  # [T] int32: position + 1 (causal)
        return (self.positions + 1).astype(np.int32)


@dataclass(slots=True)
class StepInputs:
    """Per-token and per-sequence tensors of one step on the device (the UA paged-attention metadata)."""

    input_ids: torch.Tensor     # [T] int64
    positions: torch.Tensor     # [T] int64
    token_seq: torch.Tensor     # [T] int32
    token_kv_len: torch.Tensor  # [T] int32
    slot_mapping: torch.Tensor  # [T] int64
    page_table: torch.Tensor    # [S, max_pages] int32
    sample_rows: torch.Tensor   # [N] int64
    sample_seqs: list[Sequence]


def host_step(batch: ScheduledBatch, page_size: int) -> HostStep:
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
    decode = num_tokens == len(batch.seqs) == len(sample_seqs)
    return HostStep(np.concatenate(ids), np.concatenate(pos), np.concatenate(tseq), np.concatenate(slots), table,
                    np.asarray(rows, dtype=np.int64), sample_seqs, decode)


class Staging:
    """Host buffers a step's arrays pass through on their way to the device: pinned on CUDA (so the copies do
    not block), grown on demand and reused every step. A buffer is written again only after the step that
    copied from it has synchronised (its sampled ids came back)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}

    def to_device(self, name: str, a: np.ndarray) -> torch.Tensor:
        if not self.pin:
            return torch.from_numpy(np.ascontiguousarray(a))
        buf = self._buffers.get(name)
        n = a.size
        if buf is None or buf.numel() < n or buf.dtype != _TORCH[a.dtype.str]:
            buf = self._buffers[name] = torch.empty(max(n, 1) * 2, dtype=_TORCH[a.dtype.str], pin_memory=True)
        host = buf[:n].view(a.shape)
        host.numpy()[...] = a
        return host.to(self.device, non_blocking=True)


_TORCH = {np.dtype(np.int64).str: torch.int64, np.dtype(np.int32).str: torch.int32}


def device_step(hs: HostStep, staging: Staging) -> StepInputs:
    put = staging.to_device
    return StepInputs(put("input_ids", hs.input_ids), put("positions", hs.positions), put("token_seq", hs.token_seq),
                      put("token_kv_len", hs.token_kv_len), put("slot_mapping", hs.slot_mapping),
                      put("page_table", hs.page_table), put("sample_rows", hs.sample_rows), hs.sample_seqs)


def build_step(batch: ScheduledBatch, page_size: int, device) -> StepInputs:
    """A step's device inputs (host_step, copied through fresh staging)."""
    return device_step(host_step(batch, page_size), Staging(device))


class Executor:
    def __init__(self, model: LlamaForCausalLM, kernels: KernelBackend, num_pages: int, num_cpu_pages: int,
                 page_size: int, device: str, dtype: torch.dtype):
        cfg = model.cfg
        self.model, self.kernels, self.page_size, self.device = model, kernels, page_size, device
        shape = (cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.cpu_kv = torch.zeros((*shape[:2], num_cpu_pages, *shape[3:]), dtype=dtype,
                                  pin_memory=device == "cuda" and num_cpu_pages > 0)
        self.staging = Staging(device)
        self.graphs = None  # graphs.DecodeGraphs once captured (capture_graphs)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, progress: bool = True) -> float:
        """Capture the decode graphs (CUDA only); returns the seconds it took."""
        from .graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)
        return self.graphs.capture(progress)

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

    def forward(self, step: StepInputs, plan) -> torch.Tensor:
        """The model over a step's tokens: hidden [T, E]."""
        def attention(layer: int, q, k, v):
            k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]
            self.kernels.reshape_and_cache(k=k, v=v, slot_mapping=step.slot_mapping, k_cache=k_cache, v_cache=v_cache)
            out = torch.empty_like(q)
            self.kernels.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache, token_seq=step.token_seq,
                                         page_table=step.page_table, token_kv_len=step.token_kv_len, out=out,
                                         plan=plan)
            return out

        return self.model(step.input_ids, step.positions, attention)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Returns (sequences that sample, their next-token logits [N, V] float32, on the device)."""
        self.run_cache_ops(batch)
        if not batch.seqs:
            return [], torch.empty(0, self.model.cfg.vocab_size, device=self.device)
        hs = host_step(batch, self.page_size)
        if hs.decode and self.graphs is not None and self.graphs.fits(hs):
            return hs.sample_seqs, self.graphs.replay(hs)
        step = device_step(hs, self.staging)
        plan = self.kernels.plan_step(len(hs.input_ids), len(hs.page_table), hs.page_table.shape[1] * self.page_size)
        hidden = self.forward(step, plan)
        return step.sample_seqs, self.model.logits(hidden[step.sample_rows])
