"""Structured output (runtime/structured.py): guides compiled once by llguidance, the token bitmask applied in the
sampler, the engine's matchers advanced per token and released on finish and abort; stories260K and SmolLM2."""
import json
import re

import pytest
import torch

from uacompile.models import STORIES260K, smollm2_path
from uacompile.runtime import LLM, Guide, SamplingParams
from uacompile.runtime.loader import load
from uacompile.runtime.sampling import Sampler
from uacompile.runtime.sequence import Sequence
from uacompile.runtime.structured import Grammars, GuideStates, apply_token_bitmask, mask_words

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def check_schema(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and len(obj["name"]) <= 12, text
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120, text
    return obj


@pytest.fixture(scope="module")
def stories():
    return LLM(str(STORIES260K), cpu_threads=1, progress=False)


@pytest.fixture(scope="module")
def stories_grammars():
    lm = load(str(STORIES260K))
    return Grammars(lm.tokenizer, lm.config.vocab_size, lm.config.eos_token_ids)


def reference_mask(logits, words):
    out = logits.clone()
    for i in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(words[i, t // 32]) >> (t % 32)) & 1:
                out[i, t] = float("-inf")
    return out


@pytest.mark.parametrize("V", [64, 77, 512])
def test_apply_token_bitmask_equals_the_bit_by_bit_reference(V):
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(3, V, generator=g)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, mask_words(V)), dtype=torch.int32, generator=g)
    words[1] = -1  # every token allowed
    got = apply_token_bitmask(logits, words)
    assert torch.equal(got, reference_mask(logits, words))
    assert torch.equal(got[1], logits[1])


def test_guides_check_their_spec():
    assert Guide.json_schema('{"type": "string"}') == Guide.json_schema({"type": "string"})
    for bad in (lambda: Guide.json_schema("{nope"), lambda: Guide.json_schema([1]), lambda: Guide.regex(""),
                lambda: Guide.choice([]), lambda: Guide.choice(["a", 1]), lambda: Guide.grammar(" "),
                lambda: Guide("xml", "")):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError, match="guided must be a structured.Guide"):
        SamplingParams(guided={"type": "object"})
    assert not SamplingParams(temperature=0, guided=Guide.json_object()).argmax_only


def test_compiled_once_and_evicted_least_recently_used(stories_grammars):
    g = Grammars(stories_grammars.tokenizer, stories_grammars.vocab_size, stories_grammars.eos_token_ids, capacity=2)
    a, b, c = Guide.regex("a+"), Guide.regex("b+"), Guide.regex("c+")
    for guide in (a, a, b, a, c):  # c evicts b (a was used since)
        g.compile(guide)
    assert g.compiles == 3
    g.compile(a)
    assert g.compiles == 3
    g.compile(b)
    assert g.compiles == 4


@pytest.mark.parametrize("guide,needle", [
    (Guide.json_schema({"type": "nonsense"}), "json_schema"),
    (Guide.regex("[0-9"), "regex"),
    (Guide.grammar('root ::= "a" ('), "grammar"),
    (Guide.grammar("root ::= missing"), "grammar"),
])
def test_a_guide_that_does_not_compile_is_one_line(stories_grammars, guide, needle):
    with pytest.raises(ValueError) as e:
        stories_grammars.compile(guide)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"cannot compile the {needle}"), msg


def test_mask_allows_exactly_what_the_grammar_does(stories_grammars):
    tok = stories_grammars.tokenizer
    states = GuideStates(stories_grammars)
    states.add(0, Guide.choice(["cat", "dog"]))
    seq = Sequence(0, [1], 1, SamplingParams())
    words = states.fill([seq]).for_batch([seq], "cpu")
    allowed = [t for t in range(stories_grammars.vocab_size) if (int(words[0, t // 32]) >> (t % 32)) & 1]
    assert allowed and all(tok.token_bytes(t) and ("cat".startswith(tok.token_text(t)) or
                                                   "dog".startswith(tok.token_text(t))) for t in allowed)
    states.close()


def test_each_kind_holds_the_output_with_n_and_sampling(stories):
    kinds = [(Guide.json_schema(SCHEMA), lambda t: bool(check_schema(t))),
             (Guide.regex(r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
             (Guide.choice(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
             (Guide.grammar('root ::= "The " animal " ran."\nanimal ::= "cat" | "dog" | "bird"'),
              lambda t: re.fullmatch(r"The (cat|dog|bird) ran\.", t)),
             (Guide.grammar('start: "x" /[0-9]{1,4}/ "y"'), lambda t: re.fullmatch(r"x[0-9]{1,4}y", t)),
             (Guide.json_object(), None)]
    for guide, check in kinds:
        out = stories.generate("Once upon a time", SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=64,
                                                                  guided=guide))[0]
        for c in out.outputs:
            if check is None:  # any object: stories260K runs on inside it, but the text so far parses as its start
                assert c.text.startswith("{") and (c.finish_reason == "length" or json.loads(c.text) is not None)
                continue
            assert c.finish_reason == "stop" and check(c.text), (guide.kind, c)
    assert stories.engine.num_guided == 0


def test_grammar_end_finishes_before_min_tokens_and_max_tokens_cuts_it(stories):
    out = stories.generate("Once", SamplingParams(temperature=0, min_tokens=10, max_tokens=20,
                                                  guided=Guide.choice(["yes"])))[0].outputs[0]
    assert (out.text, out.finish_reason) == ("yes", "stop")
    out = stories.generate("Once", SamplingParams(temperature=0, max_tokens=3,
                                                  guided=Guide.json_object()))[0].outputs[0]
    assert out.finish_reason == "length" and out.text.startswith("{") and len(out.token_ids) == 3


def test_stop_strings_cut_guided_output(stories):
    out = stories.generate("Once", SamplingParams(temperature=0, max_tokens=40, stop=["-"],
                                                  guided=Guide.regex(r"[0-9]{3}-[a-z]{3}")))[0].outputs[0]
    assert re.fullmatch(r"[0-9]{3}", out.text) and out.finish_reason == "stop", out


def test_unguided_requests_beside_guided_ones_are_unchanged(stories):
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = stories.generate(["Lily liked to", "One day"], plain)
    mixed = stories.generate(["Lily liked to", "Tom ran", "One day"],
                             [plain, SamplingParams(temperature=0.7, seed=5, max_tokens=40,
                                                    guided=Guide.json_schema(SCHEMA)), plain])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == \
        [alone[0].outputs[0].token_ids, alone[1].outputs[0].token_ids]
    check_schema(mixed[1].outputs[0].text)


def test_async_scheduling_advances_each_matcher_before_its_next_mask():
    llm = LLM(str(STORIES260K), cpu_threads=1, progress=False, async_scheduling=True)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=48, guided=Guide.json_schema(SCHEMA))
              for i in range(4)] + [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    outs = llm.generate(["Once upon a time"] * 5, params)
    for o in outs[:4]:
        check_schema(o.outputs[0].text)
    sync = LLM(str(STORIES260K), cpu_threads=1, progress=False)
    assert [o.outputs[0].text for o in sync.generate(["Once upon a time"] * 5, params)] == \
        [o.outputs[0].text for o in outs]


def test_abort_releases_the_matchers(stories):
    eng = stories.engine
    rid = eng.add_request("Once", SamplingParams(max_tokens=30, n=2, guided=Guide.json_object()))
    eng.step()
    eng.step()
    assert eng.num_guided == 2
    eng.abort(rid)
    eng.release(rid)
    assert eng.num_guided == 0 and not eng.has_unfinished()


def test_a_bad_guide_is_refused_at_add_request(stories):
    with pytest.raises(ValueError, match="cannot compile the regex"):
        stories.engine.add_request("Once", SamplingParams(guided=Guide.regex("(")))
    assert not stories.engine.has_unfinished()


def test_smollm2_json_schema():
    llm = LLM(str(smollm2_path()), cpu_threads=2, progress=False)
    prompt = "<|im_start|>user\nGive me a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate(prompt, SamplingParams(temperature=0.7, seed=0, n=2, max_tokens=60,
                                              guided=Guide.json_schema(SCHEMA)))[0]
    for c in out.outputs:
        assert c.finish_reason == "stop"
        check_schema(c.text)


@pytest.mark.gpu
def test_cuda_bitmask_and_guided_sampling_equal_the_cpu():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=g)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (4, mask_words(1000)), dtype=torch.int32, generator=g)
    assert torch.equal(apply_token_bitmask(logits.cuda(), words.cuda()).cpu(), apply_token_bitmask(logits, words))
    lm = load(str(STORIES260K))
    grammars = Grammars(lm.tokenizer, lm.config.vocab_size, lm.config.eos_token_ids)
    seqs = [Sequence(i, [1], 1, SamplingParams(temperature=0, guided=Guide.choice(["cat", "dog"]))) for i in range(2)]
    x = torch.randn(2, lm.config.vocab_size, generator=g)
    got = []
    for dev, pinned in (("cpu", False), ("cuda", False), ("cuda", True)):
        states = GuideStates(grammars, pinned=pinned)
        for s in seqs:
            states.add(s.seq_id, s.params.guided)
        for batch in (seqs, seqs[::-1], seqs[:1], seqs):  # in fill's order, reordered, a part, the buffers' turn
            got.append((dev, pinned, [s.seq_id for s in batch],
                        Sampler().sample(batch, x[[s.seq_id for s in batch]].to(dev), states.fill(seqs)).tokens))
        states.close()
    want = {tuple(ids): tokens for dev, _, ids, tokens in got if dev == "cpu"}
    assert all(tokens == want[tuple(ids)] for _, _, ids, tokens in got), got
