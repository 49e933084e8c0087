"""The batched sampler: each option against a plain per-row reference, seeded draws that do not
depend on the batch, the draw distribution, and SamplingParams' one-line range errors."""
import math

import numpy as np
import pytest
import torch

from uacompile.runtime.sampling import Sampler, apply_logit_bias, apply_min_tokens, apply_penalties, filter_probs
from uacompile.runtime.sequence import SamplingParams, Sequence

V = 50


def seq(i, params, prompt=(1, 2, 3), output=()):
    s = Sequence(i, [*prompt, *output], len(prompt), params)
    return s


def logits_for(rng, n):
    return torch.tensor(rng.normal(0, 2, (n, V)), dtype=torch.float32)


@pytest.mark.parametrize("kw,needle", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_p=0), "top_p must be a number in (0, 1]"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(min_p=1.5), "min_p must be a number in [0, 1]"),
    (dict(presence_penalty=2.5), "presence_penalty must be a number in [-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty must be a number in [-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty must be a number in (0, 100]"),
    (dict(seed=1 << 64), "seed must be an int in [0, 2**64 - 1]"),
    (dict(seed=-1), "seed must be an int in [0, 2**64 - 1]"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(logprobs=21), "logprobs must be an int in [0, 20]"),
    (dict(logit_bias={3: 101}), "logit_bias must map token ids >= 0 to numbers in [-100, 100]"),
    (dict(logit_bias={-1: 1}), "logit_bias must map token ids"),
    (dict(max_tokens=True), "max_tokens must be an int >= 1"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens must be an int in [0, max_tokens=4]"),
    (dict(min_tokens=-1), "min_tokens must be an int in [0, max_tokens=16]"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be a bool"),
    (dict(prompt_logprobs=21), "prompt_logprobs must be an int in [0, 20]"),
])
def test_bad_params_name_the_option_and_range(kw, needle):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_logit_bias_out_of_vocabulary():
    with pytest.raises(ValueError, match=r"logit_bias token ids \[50\] are outside the vocabulary \[0, 50\)"):
        SamplingParams(logit_bias={50: 1.0}).check_vocab(V)


def test_penalties_match_a_per_row_reference(rng):
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(),
              SamplingParams(frequency_penalty=-1.0)]
    outputs = [(4, 4, 7), (4, 9), (2, 2, 2, 11)]
    seqs = [seq(i, p, prompt=(1, 5), output=o) for i, (p, o) in enumerate(zip(params, outputs))]
    x = logits_for(rng, 3)
    got = apply_penalties(x, seqs).numpy()
    want = x.numpy().astype(np.float64).copy()
    for row, (p, s) in enumerate(zip(params, seqs)):
        for t in set(s.token_ids):
            if p.repetition_penalty != 1:
                v = want[row, t]
                want[row, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(s.output_token_ids):
            c = s.output_token_ids.count(t)
            want[row, t] -= p.frequency_penalty * c + p.presence_penalty
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_logit_bias_and_greedy(rng):
    x = logits_for(rng, 2)
    seqs = [seq(0, SamplingParams(temperature=0, logit_bias={7: 100})), seq(1, SamplingParams(temperature=0))]
    assert apply_logit_bias(x, seqs)[0, 7] == pytest.approx(float(x[0, 7]) + 100)
    out = Sampler(0).sample(seqs, x)
    assert out.tokens == {0: 7, 1: int(torch.argmax(x[1]))}


def test_filters_match_a_per_row_reference(rng):
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.6), SamplingParams(min_p=0.2, temperature=0.7),
              SamplingParams(top_k=10, top_p=0.8, min_p=0.05, temperature=1.5), SamplingParams()]
    x = logits_for(rng, len(params))
    got = filter_probs(x, [seq(i, p) for i, p in enumerate(params)]).numpy()
    for row, p in enumerate(params):
        z = x[row].double().numpy() / p.temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        keep = np.zeros(V, bool)
        mass = 0.0
        kept_mass_total = probs[order[:p.top_k or V]].sum()
        for rank, t in enumerate(order):
            if p.top_k and rank >= p.top_k:
                break
            if mass >= p.top_p * kept_mass_total:
                break
            if probs[t] < p.min_p * probs[order[0]]:
                break
            keep[t] = True
            mass += probs[t]
        want = np.where(keep, probs, 0)
        want /= want.sum()
        np.testing.assert_allclose(got[row], want, rtol=1e-4, atol=1e-6)


def test_seeded_draws_do_not_depend_on_the_batch(rng):
    """A sequence's tokens are the same sampled alone or among others, at any row."""
    p = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, seed=42, presence_penalty=0.3)
    steps = [logits_for(rng, 4) for _ in range(6)]
    alone_sampler, batch_sampler = Sampler(0), Sampler(1)
    target_alone, target_batch = seq(0, p), seq(0, p)
    others = [seq(i, SamplingParams(temperature=1.0, seed=i)) for i in (1, 2, 3)]
    alone, batched = [], []
    for step, x in enumerate(steps):
        row = step % 4
        a = alone_sampler.sample([target_alone], x[row:row + 1]).tokens[0]
        batch = others[:row] + [target_batch] + others[row:]
        b = batch_sampler.sample(batch, x).tokens[0]
        for s, t in ((target_alone, a), (target_batch, b)):
            s.append_token(t)
        alone.append(a), batched.append(b)
    assert alone == batched


def test_draws_follow_the_filtered_distribution():
    x = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [1e-9] * 4]))
    s = seq(0, SamplingParams(temperature=1.0, top_k=3, seed=5))
    sampler = Sampler()
    counts = np.zeros(8)
    for _ in range(3000):
        counts[sampler.sample([s], x).tokens[0]] += 1
    freq = counts / counts.sum()
    np.testing.assert_allclose(freq[:3], np.array([0.4, 0.3, 0.2]) / 0.9, atol=0.03)
    assert counts[3:].sum() == 0  # top-k cut the rest


def test_logprobs_are_the_models_and_sorted(rng):
    x = logits_for(rng, 2)
    seqs = [seq(0, SamplingParams(temperature=0, logprobs=3)), seq(1, SamplingParams(temperature=0))]
    out = Sampler().sample(seqs, x)
    lp = out.logprobs[0]
    ref = torch.log_softmax(x[0].double(), -1)
    assert lp.token_id == out.tokens[0] and math.isclose(lp.logprob, float(ref[lp.token_id]), abs_tol=1e-5)
    assert [t for t, _ in lp.top] == torch.topk(ref, 3).indices.tolist()
    assert 1 not in out.logprobs


@pytest.mark.gpu
def test_cuda_sampler_matches_cpu_greedy_and_is_batch_invariant(rng):
    """The same ops on the GPU: greedy (with penalties and bias) equals the CPU's; seeded draws
    do not depend on the batch there either."""
    x = logits_for(rng, 4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={3: 5.0}),
              SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=1.0), SamplingParams(top_k=1)]
    seqs = [seq(i, p, output=(3, 4, 4)) for i, p in enumerate(params)]
    assert Sampler().sample(seqs, x.cuda()).tokens == Sampler().sample(seqs, x).tokens
    p = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02, seed=9)
    alone = [Sampler().sample([seq(0, p)], x[i:i + 1].cuda()).tokens[0] for i in range(4)]
    together = Sampler().sample([seq(i, p) for i in range(4)], x.cuda()).tokens
    assert [together[i] for i in range(4)] == alone


def test_argmax_only_rows_take_the_first_maximum_and_the_others_their_options(rng):
    x = logits_for(rng, 3)
    x[0, 7] = x[0, 9] = x[0].max() + 1  # a tie: the first index wins, as torch.argmax gives it
    plain = SamplingParams(temperature=0)
    assert plain.argmax_only and SamplingParams(top_k=1).argmax_only
    others = [SamplingParams(temperature=0, logit_bias={3: 100.0}), SamplingParams(temperature=0, logprobs=1),
              SamplingParams(temperature=0, repetition_penalty=1.5), SamplingParams(temperature=0.5)]
    assert not any(p.argmax_only for p in others)
    assert Sampler().sample([seq(0, plain)], x[:1]).tokens == {0: 7}
    biased = Sampler().sample([seq(0, plain), seq(1, others[0])], x[:2])
    assert biased.tokens == {0: 7, 1: 3}
    fast = Sampler().launch([seq(i, plain) for i in range(3)], x)
    assert fast.result().tokens == {i: int(x[i].argmax()) for i in range(3)}


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(3, V)
    seqs = [Sequence(i, [1, 2] + [3] * out, 2, SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=ie))
            for i, (out, ie) in enumerate(((0, False), (2, True), (3, False)))]
    got = apply_min_tokens(logits, seqs, eos_token_ids=(5,))
    assert got[0, 5] == got[0, 7] == -math.inf and torch.isfinite(got[0, :5]).all()
    assert got[1, 7] == -math.inf and got[1, 5] == 0  # ignore_eos: EOS is an ordinary token
    assert torch.isfinite(got[2]).all()  # reached: nothing masked
    out = Sampler(0, eos_token_ids=(5,)).sample(seqs[:1], torch.nn.functional.one_hot(torch.tensor([5]), V).float())
    assert out.tokens[0] != 5  # the greedy favourite is an EOS: masked


@pytest.mark.parametrize("text,stops,floor,include,want", [
    ("ab.cd.ef", ["."], 0, False, 2),
    ("ab.cd.ef", ["."], 0, True, 3),
    ("ab.cd.ef", ["."], 3, False, 5),    # the first match ends within the floor
    ("ab.cd.ef", ["d.e"], 5, False, 4),  # a match may start within the floor and end past it
    ("ab.cd.ef", ["x", "cd", "b."], 0, False, 1),
    ("ab.cd.ef", ["x"], 0, False, None),
])
def test_stop_cut(text, stops, floor, include, want):
    assert SamplingParams(stop=stops, include_stop_str_in_output=include).stop_cut(text, floor) == want
