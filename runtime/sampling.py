"""Token sampling as batched torch ops on the logits' device; only the sampled ids (and any requested
log-probabilities) are copied back.

launch() queues the sampling ops on the logits' stream and the copy of their results to pinned host memory, with
no host synchronisation (every index and parameter goes up through pinned memory); the PendingSample it returns
waits for them in result(). sample() is both in one call.

Order per row: logit_bias, min_tokens (EOS unless ignore_eos, and stop_token_ids, masked to -inf while
the output is shorter), penalties (repetition over prompt + output, presence and frequency over
output), the structured-output token mask (-inf where the row's grammar allows no token: a bitmask from
structured.GuideStates, unpacked and applied on the logits' device), then greedy rows take the argmax; the others are divided by their temperature, softmaxed,
filtered by top-k, top-p and min-p, and sampled by the exponential race argmax(p / q),
q ~ Exp(1). Each sequence draws q from its own torch.Generator (seeded by SamplingParams.seed, else
from the sampler's seed stream), one draw per token, and every op is row-wise, so a seeded request
gives the same tokens alone or in any batch.

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
from dataclasses import dataclass, field

import torch

from .sequence import Sequence
from .structured import MaskJob, apply_token_bitmask


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token's log-probability under the model (before sampling filters) and the top ones."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first
    rank: int | None = None  # of token_id among all (1 = most likely), where known


@dataclass
class SamplerOutput:
    tokens: dict[int, int] = field(default_factory=dict)             # seq_id -> sampled token
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # seq_id -> (for requests asking)


def to_device(values, device, dtype=torch.int64) -> torch.Tensor:
    """values on device without a host synchronisation (through pinned memory on CUDA)."""
    t = torch.tensor(values, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
    return t.to(device, non_blocking=True)


def _column(values, device, dtype=torch.float32) -> torch.Tensor:
    return to_device(values, device, dtype).unsqueeze(1)


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows, cols, vals = [], [], []
    for i, s in enumerate(seqs):
        for tid, v in (s.params.logit_bias or {}).items():
            rows.append(i), cols.append(tid), vals.append(float(v))
    if not rows:
        return logits
    dev = logits.device
    return logits.index_put((to_device(rows, dev), to_device(cols, dev)), to_device(vals, dev, torch.float32),
                            accumulate=True)


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids) -> torch.Tensor:
    """-inf on the tokens that would end a sequence whose output is still shorter than its min_tokens."""
    rows, cols = [], []
    for i, s in enumerate(seqs):
        p = s.params
        if s.num_output_tokens < p.min_tokens:
            ends = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_token_ids))
            ends = [t for t in ends if t < logits.shape[1]]
            rows += [i] * len(ends)
            cols += ends
    if not rows:
        return logits
    dev = logits.device
    return logits.index_put((to_device(rows, dev), to_device(cols, dev)),
                            torch.tensor(float("-inf"), device=dev))


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[N, V] occurrence counts of each row's tokens."""
    width = max(1, max(len(t) for t in token_lists))
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
    for i, t in enumerate(token_lists):
        ids[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if torch.device(device).type == "cuda":
        ids = ids.pin_memory()
    counts.scatter_add_(1, ids.to(device, non_blocking=True), torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """vLLM's penalties: repetition (divide positive, multiply negative logits of tokens seen in the
    prompt or output), then frequency (times the output count) and presence (once if in the output)."""
    if not any(s.params.has_penalties for s in seqs):
        return logits
    dev, V = logits.device, logits.shape[1]
    out_counts = _token_counts([s.output_token_ids if s.params.has_penalties else [] for s in seqs], V, dev)
    if any(s.params.repetition_penalty != 1 for s in seqs):
        rep = _column([s.params.repetition_penalty for s in seqs], dev)
        seen = (_token_counts([s.prompt_token_ids if s.params.repetition_penalty != 1 else [] for s in seqs],
                              V, dev) + out_counts) > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    freq = _column([s.params.frequency_penalty for s in seqs], dev)
    pres = _column([s.params.presence_penalty for s in seqs], dev)
    return logits - freq * out_counts - pres * (out_counts > 0).float()


def filter_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Probabilities [N, V] after temperature, top-k, top-p (nucleus) and min-p, in float32."""
    dev, V = logits.device, logits.shape[1]
    params = [s.params for s in seqs]
    temps = _column([p.temperature if p.temperature > 0 else 1.0 for p in params], dev)
    probs = torch.softmax(logits / temps, dim=-1)
    if all(p.top_k in (0, V) and p.top_p >= 1 and p.min_p <= 0 for p in params):
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=dev).unsqueeze(0)
    ks = _column([p.top_k if 0 < p.top_k < V else V for p in params], dev, torch.int64)
    sorted_p = torch.where(rank < ks, sorted_p, torch.zeros_like(sorted_p))
    top_p = _column([p.top_p for p in params], dev)
    cum = torch.cumsum(sorted_p, dim=-1)
    # keep the smallest head of the sorted list whose mass reaches top_p (always >= 1 token)
    drop = (cum - sorted_p) >= top_p * cum[:, -1:]
    min_p = _column([p.min_p for p in params], dev)
    drop |= sorted_p < min_p * sorted_p[:, :1]
    sorted_p = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
    probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return probs / probs.sum(dim=-1, keepdim=True)


@dataclass
class PendingSample:
    """A launched sampling step: its ids (and log-probabilities) on their way to pinned host memory."""

    seqs: list[Sequence]
    tokens: torch.Tensor                 # [N] int64 on the logits' device (the next step may read it there)
    host: dict[str, torch.Tensor]        # tokens / chosen / top_v / top_i: pinned host copies
    want: list[int]                      # rows whose request asks for log-probabilities
    event: "torch.cuda.Event | None"     # recorded after the copies (None on the CPU)

    def result(self) -> SamplerOutput:
        """Wait for the copies and return the sampled ids (and log-probabilities)."""
        if self.event is not None:
            self.event.synchronize()
        ids = self.host["tokens"].tolist()
        out = SamplerOutput({s.seq_id: t for s, t in zip(self.seqs, ids)})
        if self.want:
            chosen = self.host["chosen"].tolist()
            top_v, top_i = self.host["top_v"].tolist(), self.host["top_i"].tolist()
            for j, i in enumerate(self.want):
                kk = self.seqs[i].params.logprobs
                out.logprobs[self.seqs[i].seq_id] = TokenLogprob(ids[i], chosen[j],
                                                                 list(zip(top_i[j][:kk], top_v[j][:kk])))
        return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class Sampler:
    def __init__(self, seed: int | None = None, eos_token_ids=()):
        self._seeds = random.Random(seed)  # seeds for requests that bring none
        self.eos_token_ids = tuple(eos_token_ids)  # masked until a request's min_tokens
        self._generators: dict[int, torch.Generator] = {}

    def generator(self, seq: Sequence, device) -> torch.Generator:
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(seq.params.seed if seq.params.seed is not None else self._seeds.getrandbits(63))
            self._generators[seq.seq_id] = g
        return g

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, masks: MaskJob | None = None) -> SamplerOutput:
        """logits [N, V] (row i for seqs[i]) -> the sampled token of every sequence, and log-probs of
        those whose request asks for them. masks: the guided sequences' token bitmask (structured.GuideStates.fill)."""
        return self.launch(seqs, logits, masks).result()

    def launch(self, seqs: list[Sequence], logits: torch.Tensor, masks: MaskJob | None = None) -> PendingSample:
        """Queue sample() on the logits' device; result() on what it returns waits for the ids. Reads the
        sequences' tokens on the host only for penalties; waits for the grammar masks' worker when given one."""
        dev = logits.device
        if not seqs:
            return PendingSample([], torch.empty(0, dtype=torch.int64, device=dev),
                                 {"tokens": torch.empty(0, dtype=torch.int64)}, [], None)
        if dev.type == "cpu" and all(s.params.argmax_only for s in seqs):  # the ids are on the host already
            tokens = torch.argmax(logits, dim=-1)
            return PendingSample(list(seqs), tokens, {"tokens": tokens}, [], None)
        raw = logits.float()
        x = apply_penalties(apply_min_tokens(apply_logit_bias(raw, seqs), seqs, self.eos_token_ids), seqs)
        bitmask = masks.for_batch(seqs, dev) if masks is not None else None
        if bitmask is not None:
            x = apply_token_bitmask(x, bitmask)
        greedy = [s.params.greedy for s in seqs]
        tokens = torch.argmax(x, dim=-1)  # first index among ties
        if not all(greedy):
            rows = to_device([i for i, g in enumerate(greedy) if not g], dev)
            sub = [s for s, g in zip(seqs, greedy) if not g]
            probs = filter_probs(x[rows], sub)
            q = torch.empty_like(probs)
            for j, seq in enumerate(sub):
                q[j].exponential_(generator=self.generator(seq, dev))
            tokens[rows] = torch.argmax(probs / q, dim=-1)
        host = {"tokens": _to_host(tokens)}
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:
            w = to_device(want, dev)
            lp = torch.log_softmax(raw[w], dim=-1)
            host["chosen"] = _to_host(lp.gather(1, tokens[w].unsqueeze(1)).squeeze(1))
            k = max(seqs[i].params.logprobs for i in want)
            top_v, top_i = torch.topk(lp, k, dim=-1)
            host["top_v"], host["top_i"] = _to_host(top_v), _to_host(top_i)
        event = None
        if dev.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingSample(list(seqs), tokens, host, want, event)
