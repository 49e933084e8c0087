"""A step's inputs: built on the host from a ScheduledBatch (host_step), then copied to the device through reused
(pinned on CUDA) host buffers without blocking (Staging, device_step)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .scheduler import ScheduledBatch
from .sequence import Sequence


@dataclass(slots=True)
class HostStep:
    """One step's inputs on the host (numpy), before any copy to the device."""

    input_ids: np.ndarray     # [T] int64
    positions: np.ndarray     # [T] int64
    token_kv_len: np.ndarray  # [T] int32: cache slots a token sees (its slot + 1: causal)
    token_seq: np.ndarray     # [T] int32: which batch row each token belongs to
    slot_mapping: np.ndarray  # [T] int64: page * P + offset
    page_table: np.ndarray    # [S, max_pages] int32, -1 past a sequence's pages
    sample_rows: np.ndarray   # [N] int64: token rows whose logits are sampled
    sample_seqs: list[Sequence]
    decode: bool              # every sequence computes exactly one token and samples it


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
    """Positions are token indices; cache slots are positions less the sequence's evicted tokens."""
    ids, pos, kvl, tseq, slots, rows, sample_seqs = [], [], [], [], [], [], []
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
        c0 = start - seq.num_evicted
        if len(seq.block_table) * page_size < c0 + n:
            raise ValueError(f"batch: sequence {seq.seq_id} has {len(seq.block_table)} pages for {c0 + n} cached tokens")
        bt = np.asarray(seq.block_table, dtype=np.int64)
        table[i, :len(bt)] = bt
        p = np.arange(start, start + n, dtype=np.int64)
        c = p - seq.num_evicted
        ids.append(np.asarray(seq.token_ids[start:start + n], dtype=np.int64))
        pos.append(p)
        kvl.append((c + 1).astype(np.int32))
        tseq.append(np.full(n, i, dtype=np.int32))
        slots.append(bt[c // page_size] * page_size + c % page_size)
        num_tokens += n
        if samples[i]:  # the logits of a sequence's last token give its next one
            rows.append(num_tokens - 1)
            sample_seqs.append(seq)
    decode = num_tokens == len(batch.seqs) == len(sample_seqs)
    return HostStep(np.concatenate(ids), np.concatenate(pos), np.concatenate(kvl), np.concatenate(tseq),
                    np.concatenate(slots), table,
                    np.asarray(rows, dtype=np.int64), sample_seqs, decode)


class Staging:
    """Host buffers a step's arrays pass through on their way to the device: pinned on CUDA (so the copies do
    not block), grown on demand and reused. Two sets, one a step (flip()): while the copies of step n + 1 may
    still be queued behind step n, step n + 2 writes the other set, which step n used and finished with (the
    engine has its sampled ids before it builds step n + 2)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self._sets: tuple[dict, dict] = ({}, {})
        self._buffers: dict[str, torch.Tensor] = self._sets[0]

    def flip(self) -> None:
        """The next step's set."""
        self._buffers = self._sets[self._buffers is self._sets[0]]

    def host(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """This step's pinned host buffer `name` as a tensor of shape (contents left from an earlier step)."""
        n = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(max(n, 1) * 2, dtype=dtype, pin_memory=True)
        return buf[:n].view(shape)

    def to_device(self, name: str, a: np.ndarray) -> torch.Tensor:
        if not self.pin:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
        host = self.host(name, a.shape, _TORCH[a.dtype.str])
        host.numpy()[...] = a
        return host.to(self.device, non_blocking=True)


_TORCH = {np.dtype(np.int64).str: torch.int64, np.dtype(np.int32).str: torch.int32}


def fill_pending(input_ids: torch.Tensor, sampled: torch.Tensor) -> None:
    """Token ids not yet known on the host are coded -1 - j: the in-flight step's sample j, read here, in place,
    from its ids on the device (sampled) — the step after it runs without waiting for them."""
    input_ids.copy_(torch.where(input_ids < 0, sampled[(-1 - input_ids).clamp(min=0)], input_ids))


def device_step(hs: HostStep, staging: Staging) -> StepInputs:
    put = staging.to_device
    return StepInputs(put("input_ids", hs.input_ids), put("positions", hs.positions), put("token_seq", hs.token_seq),
                      put("token_kv_len", hs.token_kv_len), put("slot_mapping", hs.slot_mapping),
                      put("page_table", hs.page_table), put("sample_rows", hs.sample_rows), hs.sample_seqs)


def build_step(batch: ScheduledBatch, page_size: int, device) -> StepInputs:
    """A step's device inputs (host_step, copied through fresh staging)."""
    return device_step(host_step(batch, page_size), Staging(device))
