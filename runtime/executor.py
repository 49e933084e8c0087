"""Runs one ScheduledBatch: cache moves, then the model over the step's tokens, then the logits
of the sequences that sample. The paged KV cache of all layers is one tensor
kv [num_layers, 2, num_pages, P, Hkv, D] (CopyBlocks/SwapBlocks layout) in the cache's dtype (KernelOps.kv_dtype:
the model's, or int8 / fp8_e4m3), and the swap pool is a CPU tensor of the same layout (pinned on CUDA). An 8-bit
cache keeps its float32 scales beside it, scales [num_layers, 2, num_pages, P, Hkv] (one per page, slot and KV
head; the swap pool has its own), so every page move (swap_blocks, copy_blocks) takes them with the same mapping,
and a page shared through the prefix cache shares its scales with it. The CPU offload tier (offload.py) is a third
tensor of that layout (pinned on CUDA, with its own scales); its copies run on a copy engine (their own CUDA stream;
on the CPU, at once), after the step's other cache ops, and are done when their ticket says so.

A step's inputs are built on the host into reused (pinned on CUDA) buffers and copied to the device
without blocking; nothing here waits for the GPU, so the engine can build step n + 1 while step n runs. Token
ids that step n is still sampling are coded -1 - j in the sequences and read from its ids on the device
(step.fill_pending). Attention is planned once a step and run every layer. On CUDA, decode steps (one new token
a sequence) replay a CUDA graph captured at start-up for their batch-size bucket and page-table width
(graphs.py); prefill and mixed steps run eagerly. On the tvm-cpu backend, a lone sequence's decode steps replay
the kernel calls of one recorded forward (cpu_decode.py).

KV eviction: a batch's score rows (ScheduledBatch.score) run the kv_score op every layer, after that layer's
attention, over the last kv_window queries of each scored chunk; after the forward each scored sequence's tokens to
keep are chosen per layer and KV head on the device (the kv_sink first and kv_recent last tokens, then the highest
scores, in cache order) and held until the next step, whose batch.evictions gathers them into the new pages with one
gather_tokens launch before any other cache op (compaction aside, which such a step does not plan).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from uacompile import ir

from .cpu_decode import CpuDecodeProgram
from .graphs import DecodeGraphs
from .kernels import KernelBackend, TVMCPUBackend
from .model import LlamaForCausalLM
from .offload import OffloadPlan, StreamCopies, SyncCopies
from .sampling import TokenLogprob
from .scheduler import ScheduledBatch
from .sequence import Sequence
from .step import HostStep, Staging, StepInputs, device_step, fill_pending, host_step


@dataclass
class ScoreInputs:
    """One step's kv_score launches: the scored sequences' window queries (rows of the step's q), their cache."""

    rows: torch.Tensor          # [NQ] int64: the window queries' rows of the step's tokens
    query_seq: torch.Tensor     # [NQ] int32: which scored sequence each belongs to
    query_kv_len: torch.Tensor  # [NQ] int32
    page_table: torch.Tensor    # [Se, max_pages] int32
    kv_len: torch.Tensor        # [Se] int32
    scores: torch.Tensor        # [num_layers, Se, Hkv, max_kv_len] float32
    seqs: list[tuple[int, int, int]]  # (seq_id, tokens to keep, kv_len) of each scored sequence


class Executor:
    def __init__(self, model: LlamaForCausalLM, kernels: KernelBackend, num_pages: int, num_cpu_pages: int,
                 page_size: int, device: str, num_offload_pages: int = 0, kv_window: int = 32, kv_sink: int = 4,
                 kv_recent: int = 32):
        cfg = model.cfg
        self.kv_window, self.kv_sink, self.kv_recent = kv_window, kv_sink, kv_recent
        self.keep: dict[int, torch.Tensor] = {}  # seq_id -> [num_layers, Hkv, keep] int64: the last scores' choice
        self.model, self.kernels, self.page_size, self.device = model, kernels, page_size, device
        dtype = ir.torch_dtype(kernels.ops.kv_dtype)
        spare = 4 // math.gcd(page_size * cfg.num_kv_heads, 4)
        if kernels.ops.quantized:  # each layer's K / V scales start 16-byte aligned (CUDA reads them so): spare pages
            num_pages += -num_pages % spare  # the KV manager never hands out
        shape = (cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        pin = device == "cuda" and num_cpu_pages > 0
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.cpu_kv = torch.zeros((*shape[:2], num_cpu_pages, *shape[3:]), dtype=dtype, pin_memory=pin)
        self.scales = self.cpu_scales = None  # float32 [num_layers, 2, pages, P, Hkv] of an 8-bit cache
        if kernels.ops.quantized:
            self.scales = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.cpu_scales = torch.zeros((*shape[:2], num_cpu_pages, *shape[3:-1]), dtype=torch.float32,
                                          pin_memory=pin)
        self.offload_kv = self.offload_scales = None  # the CPU offload tier's pages
        if num_offload_pages:
            off_pin = device == "cuda"
            if kernels.ops.quantized:  # aligned as the device pool's (spare pages the tier never hands out)
                num_offload_pages += -num_offload_pages % spare
            self.offload_kv = torch.zeros((*shape[:2], num_offload_pages, *shape[3:]), dtype=dtype, pin_memory=off_pin)
            if kernels.ops.quantized:
                self.offload_scales = torch.zeros((*shape[:2], num_offload_pages, *shape[3:-1]), dtype=torch.float32,
                                                  pin_memory=off_pin)
        self.copy_engine = StreamCopies(device) if device == "cuda" and num_offload_pages else SyncCopies()
        self.layer_caches = []  # each layer's (k_cache, v_cache, k_scale, v_scale) views, made once
        for i in range(cfg.num_layers):
            scales = (self.scales[i, 0], self.scales[i, 1]) if self.scales is not None else (None, None)
            self.layer_caches.append((self.kv[i, 0], self.kv[i, 1], *scales))
        self.staging = Staging(device)
        self.graphs = None  # graphs.DecodeGraphs once captured (capture_graphs)
        # tvm-cpu: a lone sequence's decode steps replay one recorded forward (cpu_decode)
        self.decode_program = (CpuDecodeProgram(self, kernels, num_pages) if isinstance(kernels, TVMCPUBackend)
                               else None)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, progress: bool = True) -> float:
        """Capture the decode graphs (CUDA only); returns the seconds it took."""
        self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)
        return self.graphs.capture(progress)

    def _mapping(self, name: str, pairs) -> torch.Tensor:
        return self.staging.to_device(name, np.asarray(pairs, dtype=np.int64).reshape(-1, 2))

    def run_cache_ops(self, batch: ScheduledBatch) -> None:
        """Order matters: compaction renames the pages the others name; swap-out frees pages that swap-in and
        copy-on-write may reuse; the offload copies start after all of them (on their own stream on CUDA)."""
        if batch.moves:
            self.kernels.copy_blocks(kv=self.kv, mapping=self._mapping("moves", batch.moves), scales=self.scales)
        if batch.evictions:
            self._gather(batch)
        self.keep.clear()  # a choice not evicted in the step after its scores is stale
        if batch.swap_out:
            self.kernels.swap_blocks(src=self.kv, dst=self.cpu_kv, mapping=self._mapping("swap_out", batch.swap_out),
                                     src_scales=self.scales, dst_scales=self.cpu_scales)
        if batch.swap_in:
            self.kernels.swap_blocks(src=self.cpu_kv, dst=self.kv, mapping=self._mapping("swap_in", batch.swap_in),
                                     src_scales=self.cpu_scales, dst_scales=self.scales)
        if batch.copies:
            self.kernels.copy_blocks(kv=self.kv, mapping=self._mapping("copies", batch.copies), scales=self.scales)
        if batch.offload:
            self.launch_offload(batch.offload)

    def _gather(self, batch: ScheduledBatch) -> None:
        """The kept tokens of every eviction into their new pages: one gather_tokens launch."""
        P, dev, srcs, dsts = self.page_size, self.kv.device, [], []
        for ev in batch.evictions:
            idx = self.keep.get(ev.seq_id)
            if idx is None or idx.shape[-1] != ev.keep:
                raise RuntimeError(f"eviction of sequence {ev.seq_id}: no choice of {ev.keep} tokens from its scores")
            old = torch.tensor(ev.old_pages, dtype=torch.int64, device=dev)
            new = torch.tensor(ev.new_pages, dtype=torch.int64, device=dev)
            srcs.append(old[idx // P] * P + idx % P)
            t = torch.arange(ev.keep, dtype=torch.int64, device=dev)
            dsts.append(new[t // P] * P + t % P)
        self.kernels.gather_tokens(kv=self.kv, src_slots=torch.cat(srcs, dim=2).contiguous(),
                                   dst_slots=torch.cat(dsts), scales=self.scales)

    def _score_inputs(self, batch: ScheduledBatch, hs: HostStep) -> ScoreInputs:
        starts = np.concatenate([[0], np.cumsum(batch.num_new_tokens)])
        rows, qseq, tables, lens, seqs = [], [], [], [], []
        for e, (i, keep) in enumerate(batch.score):
            end = int(starts[i + 1])
            w = min(self.kv_window, batch.num_new_tokens[i])
            rows.append(np.arange(end - w, end, dtype=np.int64))
            qseq.append(np.full(w, e, dtype=np.int32))
            tables.append(hs.page_table[i])
            lens.append(int(hs.token_kv_len[end - 1]))
            seqs.append((batch.seqs[i].seq_id, keep, lens[-1]))
        r = np.concatenate(rows)
        dev, cfg = self.kv.device, self.model.cfg
        put = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        scores = torch.empty((cfg.num_layers, len(seqs), cfg.num_kv_heads, max(lens)), dtype=torch.float32, device=dev)
        return ScoreInputs(put(r), put(np.concatenate(qseq)), put(hs.token_kv_len[r]), put(np.stack(tables)),
                           put(np.asarray(lens, dtype=np.int32)), scores, seqs)

    def _choose(self, score: ScoreInputs) -> None:
        """Per layer and KV head: the sink and recent tokens, then the best scores, up to each budget."""
        for e, (seq_id, keep, L) in enumerate(score.seqs):
            s = score.scores[:, e, :, :L].clone()
            s[..., :self.kv_sink] = math.inf
            s[..., max(0, L - self.kv_recent):] = math.inf
            self.keep[seq_id] = torch.topk(s, keep, dim=-1, sorted=False).indices.sort(dim=-1).values

    def launch_offload(self, plan: OffloadPlan) -> None:
        """Start a plan's copies on the copy engine; plan.ticket says when they are done."""
        def mapping(pairs):  # its own buffers: the copies may outlive this step's staging
            host = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
            return host.pin_memory().to(self.device, non_blocking=True) if self.device == "cuda" else host

        def launch():
            keep = []
            if plan.save:
                m = mapping(plan.save)
                self.kernels.swap_blocks(src=self.kv, dst=self.offload_kv, mapping=m, src_scales=self.scales,
                                         dst_scales=self.offload_scales)
                keep.append(m)
            if plan.restore:
                m = mapping(plan.restore)
                self.kernels.swap_blocks(src=self.offload_kv, dst=self.kv, mapping=m, src_scales=self.offload_scales,
                                         dst_scales=self.scales)
                keep.append(m)
            return keep

        plan.ticket = self.copy_engine.submit(launch)

    def forward(self, step: StepInputs, plan, score: ScoreInputs | None = None) -> torch.Tensor:
        """The model over a step's tokens: hidden [T, E]; with score, each layer's kv_score after its attention."""
        caches = self.layer_caches

        def attention(layer: int, q, k, v):
            k_cache, v_cache, k_scale, v_scale = caches[layer]
            self.kernels.reshape_and_cache(k=k, v=v, slot_mapping=step.slot_mapping, k_cache=k_cache, v_cache=v_cache,
                                           k_scale=k_scale, v_scale=v_scale)
            out = torch.empty_like(q)
            self.kernels.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache, token_seq=step.token_seq,
                                         page_table=step.page_table, token_kv_len=step.token_kv_len, out=out,
                                         plan=plan, k_scale=k_scale, v_scale=v_scale)
            if score is not None:
                self.kernels.kv_score(q=q.index_select(0, score.rows), k_cache=k_cache, v_cache=v_cache,
                                      query_seq=score.query_seq, query_kv_len=score.query_kv_len,
                                      page_table=score.page_table, kv_len=score.kv_len, scores=score.scores[layer])
            return out

        op = self.model.prologue
        if op is not None:
            def prologue(layer: int, qkv, q_norm, k_norm):
                """The packed projection qkv [T, Hq + 2 Hkv, D] -> attention out: norms, RoPE and the cache write in
                one launch (ir.QKVRopeCache), then the paged-attention launch."""
                k_cache, v_cache, k_scale, v_scale = caches[layer]
                q = torch.empty((qkv.shape[0], op.num_q_heads, op.head_dim), dtype=qkv.dtype, device=qkv.device)
                self.kernels.qkv_rope_cache(op, qkv=qkv, positions=step.positions, slot_mapping=step.slot_mapping, q_out=q,
                                            k_cache=k_cache, v_cache=v_cache, q_norm=q_norm, k_norm=k_norm,
                                            k_scale=k_scale, v_scale=v_scale)
                out = torch.empty_like(q)
                self.kernels.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache, token_seq=step.token_seq,
                                             page_table=step.page_table, token_kv_len=step.token_kv_len, out=out,
                                             plan=plan, k_scale=k_scale, v_scale=v_scale)
                return out

            attention.prologue = prologue
        return self.model(step.input_ids, step.positions, attention)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, pending: torch.Tensor | None = None) -> tuple[list[Sequence], torch.Tensor]:
        """Returns (sequences that sample, their next-token logits [N, V] float32, on the device). pending: the
        in-flight step's sampled ids on the device, where the batch's token ids code some of them (-1 - j)."""
        self.staging.flip()
        if self.decode_program is not None and self.decode_program.fits(batch):
            logits = self.decode_program.run(batch)
            if logits is not None:
                return list(batch.seqs), logits
        self.run_cache_ops(batch)
        if not batch.seqs:
            return [], torch.empty(0, self.model.cfg.vocab_size, device=self.device)
        hs = host_step(batch, self.page_size)
        if hs.input_ids.min() < 0:
            if pending is None:
                raise ValueError("batch: token ids still being sampled (coded < 0) but no in-flight step's ids given")
        else:
            pending = None
        if hs.decode and self.graphs is not None and self.graphs.fits(hs) and not batch.score:
            return hs.sample_seqs, self.graphs.replay(hs, pending)
        step = device_step(hs, self.staging)
        if pending is not None:
            fill_pending(step.input_ids, pending)
        plan = self.kernels.plan_step(len(hs.input_ids), len(hs.page_table), hs.page_table.shape[1] * self.page_size)
        score = self._score_inputs(batch, hs) if batch.score else None
        hidden = self.forward(step, plan, score)
        if score is not None:
            self._choose(score)
        self._prompt_logprobs(batch, hidden)
        return step.sample_seqs, self.model.logits(hidden[step.sample_rows])

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """For sequences whose request asks for prompt log-probabilities, the log-softmax of every row of their
        prompt chunk gives the next prompt token's entry (and the top k), appended to seq.prompt_logprobs; a
        position already recorded (a recomputation after preemption) is not recorded again. Waits for the
        device: only steps with such a request pay for it."""
        row = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            k = seq.params.prompt_logprobs
            start, row0 = seq.num_computed_tokens, row
            row += n
            if k is None:
                continue
            lo, hi = max(start, len(seq.prompt_logprobs)), min(start + n, seq.num_prompt_tokens - 1)
            if lo >= hi:
                continue
            lp = torch.log_softmax(self.model.logits(hidden[row0 + lo - start:row0 + hi - start]).float(), dim=-1)
            targets = torch.tensor(seq.token_ids[lo + 1:hi + 1], device=lp.device)
            chosen = lp.gather(1, targets.unsqueeze(1))
            ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
            top_v, top_i = (torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
            for t, c, r, tv, ti in zip(targets.tolist(), chosen[:, 0].tolist(), ranks, top_v.tolist(), top_i.tolist()):
                seq.prompt_logprobs.append(TokenLogprob(t, c, list(zip(ti, tv)), r))
