"""Decode steps replayed from CUDA graphs, captured at start-up.

One graph per (batch-size bucket, page-table width bucket): buckets 1, 2, 4, 8, 16, 32, ... up to max_num_seqs,
widths 16, 32, 64, ... pages up to max_model_len's. Each graph runs the whole decode forward (embedding, every
layer's cache write and planned attention, the final norm and the logits of every row) over static input
buffers and the executor's KV tensors (an 8-bit cache's scales too: every captured cache write and attention
launch takes its layer's k_scale / v_scale, views at fixed addresses); a step copies its inputs into them (from
pinned host buffers, without blocking) and replays the smallest graph that holds it. Rows past the step's
sequences are padding: they write no cache slot (slot -1) and attend one position of page 0, so they read valid
memory (scales included) and their logits are ignored. The attention plan of
each graph (its split count, workspaces) is made before its capture and kept with it.

A capture runs in CUDA's thread-local mode: what other threads do meanwhile (another engine's steps, a copy
thread, a synchronize) neither fails nor invalidates it; only this thread's own calls must be capture-safe.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .step import StepInputs, fill_pending

log = logging.getLogger("uacompile.runtime")

MIN_WIDTH = 16  # pages of the narrowest page-table bucket


def buckets(limit: int, start: int = 1) -> list[int]:
    """start, 2 start, 4 start, ... below limit, then limit itself."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    plan: object
    logits: torch.Tensor  # [bs, V] float32, written by every replay


class DecodeGraphs:
    def __init__(self, executor, max_num_seqs: int, max_model_len: int):
        self.ex = executor
        P = executor.page_size
        self.sizes = buckets(max_num_seqs)
        self.widths = buckets(max(1, -(-max_model_len // P)), min(MIN_WIDTH, max(1, -(-max_model_len // P))))
        B, dev = self.sizes[-1], executor.device
        self.B = B
        # static inputs: the graphs read these addresses on every replay
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self.token_seq = torch.arange(B, dtype=torch.int32, device=dev)
        self.token_kv_len = torch.ones(B, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int64, device=dev)
        self.tables = {w: torch.zeros((B, w), dtype=torch.int32, device=dev) for w in self.widths}
        st = executor.staging
        for _ in range(2):  # the pinned host side of those inputs (replay), both staging sets sized before serving
            for name in ("graph_ids", "graph_pos", "graph_slot"):
                st.host(name, (B,), torch.int64)
            st.host("graph_len", (B,), torch.int32)
            st.host("graph_table", (B, self.widths[-1]), torch.int32)
            st.flip()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None
        self.replays = 0  # decode steps served from a graph

    def fits(self, hs) -> bool:
        return len(hs.input_ids) <= self.B and hs.page_table.shape[1] <= self.widths[-1]

    def _bucket(self, n: int, pages: int) -> tuple[int, int]:
        return next(b for b in self.sizes if b >= n), next(w for w in self.widths if w >= pages)

    def _step(self, bs: int, w: int) -> StepInputs:
        return StepInputs(self.input_ids[:bs], self.positions[:bs], self.token_seq[:bs], self.token_kv_len[:bs],
                          self.slot_mapping[:bs], self.tables[w][:bs], None, [])

    def capture(self, progress: bool = True) -> float:
        """Capture every (size, width) graph, widest and largest first (they share one memory pool)."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        ex, P = self.ex, self.ex.page_size
        pairs = [(bs, w) for w in reversed(self.widths) for bs in reversed(self.sizes)]
        plans = {(bs, w): ex.kernels.plan_step(bs, bs, w * P) for bs, w in pairs}  # workspaces grown first
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        with torch.inference_mode():
            for bs, w in tqdm(pairs, desc="capturing decode graphs", unit="graph", disable=not progress,
                              dynamic_ncols=True):
                step, plan = self._step(bs, w), plans[(bs, w)]

                def run():
                    return ex.model.logits(ex.forward(step, plan))

                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    run()  # warm-up: kernels loaded, lazy allocations made, outside the graph
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                    logits = run()
                self.graphs[(bs, w)] = _Graph(graph, plan, logits)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        log.info("captured %d decode graphs (batch sizes %s, page-table widths %s) in %.1f s",
                 len(self.graphs), self.sizes, self.widths, seconds)
        return seconds

    def replay(self, hs, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, V] of a decode step (n sequences, one token each) from its bucket's graph; pending: the
        in-flight step's sampled ids where hs.input_ids codes them (-1 - j, step.fill_pending)."""
        n, pages = len(hs.input_ids), hs.page_table.shape[1]
        bs, w = self._bucket(n, pages)
        g = self.graphs[(bs, w)]
        host = self.ex.staging.host  # this step's pinned buffers (the executor's staging: two sets, one a step)
        h_ids, h_pos, h_slot = (host(name, (bs,), torch.int64) for name in ("graph_ids", "graph_pos", "graph_slot"))
        h_len, h_table = host("graph_len", (bs,), torch.int32), host("graph_table", (bs, w), torch.int32)
        ids, pos, ln, slot, table = (t.numpy() for t in (h_ids, h_pos, h_len, h_slot, h_table))
        ids[:n], pos[:n], slot[:n] = hs.input_ids, hs.positions, hs.slot_mapping
        ln[:n] = hs.token_kv_len
        ids[n:], pos[n:], slot[n:], ln[n:] = 0, 0, -1, 1  # padding rows
        table[:n, :pages] = hs.page_table
        table[:n, pages:] = -1
        table[n:] = 0
        self.input_ids[:bs].copy_(h_ids, non_blocking=True)
        self.positions[:bs].copy_(h_pos, non_blocking=True)
        self.token_kv_len[:bs].copy_(h_len, non_blocking=True)
        self.slot_mapping[:bs].copy_(h_slot, non_blocking=True)
        self.tables[w][:bs].copy_(h_table, non_blocking=True)
        if pending is not None:
            fill_pending(self.input_ids[:n], pending)
        g.graph.replay()
        self.replays += 1
        return g.logits[:n]


__all__ = ["DecodeGraphs", "buckets"]
