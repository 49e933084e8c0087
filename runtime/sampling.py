"""Token sampling: greedy, or temperature / top-k / top-p with one torch.Generator per sequence.

What is guaranteed (tests/runtime/test_sampling_guarantees.py checks each):

1. Each sequence draws from its own generator (seeded by SamplingParams.seed, else by the
   engine's seed stream in arrival order), one draw per sampled token: other requests in the
   batch never consume or shift its random numbers. Given the same logits, a seeded request
   samples the same tokens alone or in any batch.
2. The same requests, added in the same order with the same engine options, give the same
   tokens on every run on one machine and backend, preemptions included.

What is not guaranteed: the same tokens for a request alone and in a batch, or with and
without a preemption. The logits themselves change in the last bits with the batch around a
sequence (matmuls over a different number of rows are blocked differently) and when a
preempted sequence recomputes its tokens as one prefill instead of one decode at a time
(stories260K in float32 on the CPU: most rows differ, by up to about 3e-5). A draw within
that distance of the boundary between two tokens (or a top-p cut) takes the other token,
and the text diverges from there; greedy decoding diverges likewise where the top two
logits are that close. Seeded sampling is reproducible run to run, not batch to batch.
"""
from __future__ import annotations

import random

import torch

from .sequence import SamplingParams, Sequence


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k and top-p (nucleus) filtering, in float32."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_k and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=0)
        # keep the smallest head of the sorted list whose mass reaches top_p (always >= 1 token)
        drop = (cum - sorted_p) >= params.top_p * cum[-1]
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs / probs.sum()


class Sampler:
    def __init__(self, seed: int | None = None):
        self._seeds = random.Random(seed)  # seeds for requests that bring none
        self._generators: dict[int, torch.Generator] = {}

    def generator(self, seq: Sequence) -> torch.Generator:
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device="cpu")
            g.manual_seed(seq.params.seed if seq.params.seed is not None else self._seeds.getrandbits(63))
            self._generators[seq.seq_id] = g
        return g

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> dict[int, int]:
        """logits [N, V] (row i for seqs[i]) -> {seq_id: token}."""
        out = {}
        logits = logits.float().cpu()
        for seq, row in zip(seqs, logits):
            if seq.params.greedy:
                out[seq.seq_id] = int(torch.argmax(row))  # first index among ties
            else:
                probs = filter_logits(row, seq.params)
                out[seq.seq_id] = int(torch.multinomial(probs, 1, generator=self.generator(seq)))
        return out
