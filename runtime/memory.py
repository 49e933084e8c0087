"""How much of the GPU the KV cache may take: like vLLM's gpu_memory_utilization, after profiling the weights and
the peak activation of the largest step the scheduler may run; and what one page of it costs in bytes (page_bytes),
which turns a budget into pages: an 8-bit cache (int8 / fp8_e4m3, with its float32 scales) buys about twice the
pages of a 16-bit one."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from uacompile import ir

log = logging.getLogger("uacompile.runtime")

GIB = 1 << 30
GRAPH_RESERVE = 256 << 20  # the decode graphs' private pool (their activations at the largest batch), kept aside
SCALE_BYTES = 4  # a quantised cache's scale (float32) per page, slot and KV head, K and V each


def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, kv_dtype: str) -> int:
    """Bytes of one KV page over all layers, K and V: head_dim elements of kv_dtype (an IR name) a (slot, KV head),
    and for a quantised cache its float32 scale beside them (the executor's scales tensor)."""
    dt = ir.DTYPES[kv_dtype]
    per_row = head_dim * dt.itemsize + (SCALE_BYTES if kv_dtype in ir.QUANT_DTYPES else 0)
    return num_layers * 2 * page_size * num_kv_heads * per_row


@dataclass(frozen=True)
class MemoryProfile:
    total: int           # the device's memory
    weights: int         # allocated after the model loaded
    activation: int      # the largest step's peak above the weights
    kv_budget: int       # what the KV cache may take: utilization * total - the rest

    def describe(self) -> str:
        return (f"{self.total / GIB:.1f} GiB GPU: weights {self.weights / GIB:.2f} GiB, peak activation "
                f"{self.activation / GIB:.2f} GiB, KV budget {self.kv_budget / GIB:.2f} GiB")


@torch.inference_mode()
def profile(model, max_tokens: int, max_seqs: int, utilization: float, device=None) -> MemoryProfile:
    """Run the model once over max_tokens tokens (attention stubbed: its output is q-shaped, as the kernel's) with
    the logits of max_seqs rows, and size the KV budget from the peak."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    device = torch.device(device or "cuda")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
    pos = torch.arange(max_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, pos, lambda layer, q, k, v: torch.empty_like(q))
    model.logits(hidden[:max_seqs])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del ids, pos, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)  # other processes, the CUDA context
    budget = int(utilization * total) - base - peak - GRAPH_RESERVE - max(0, used_by_others)
    return MemoryProfile(total, base, peak, budget)


__all__ = ["MemoryProfile", "profile", "page_bytes", "GRAPH_RESERVE", "SCALE_BYTES"]
