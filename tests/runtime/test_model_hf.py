"""Hugging Face checkpoints (tiny random Llama / Qwen2 / Qwen3 / Mistral made here): the runtime's
logits, through the paged cache and one attention launch per layer for a mixed batch, match
transformers' logits; greedy generation matches transformers token for token."""
import json

import pytest

import transformers  # noqa: F401

from model_helpers import assert_logits_match, hf_greedy, make_hf_model, runtime_logits, saved_hf_model  # noqa: E402

from uacompile.runtime import LLM, SamplingParams  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    "llama": ("llama", {}),
    "llama3-rope-tied": ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {"hidden_size": 48}),  # head_dim 16 * 4 heads != hidden 48
    "mistral-window": ("mistral", {"sliding_window": 6}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    return (request.param, *saved_hf_model(tmp_path_factory, request.param, arch, len(request.param), **overrides))


def test_logits_match_transformers(case, rng):
    name, model, path = case
    llm = LLM(str(path), cpu_threads=1, page_size=4, num_pages=64)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (13, 9, 6)]
    # one sequence prefills in chunks, one decodes token by token, one prefills at once: mixed batches
    chunks = [[5, 4, 1, 1, 1, 1], [1] * 9, [6]]
    assert_logits_match(model, prompts, runtime_logits(llm.engine.executor, prompts, chunks, rng), 2e-4, name)


def test_greedy_generation_matches_transformers(case, rng):
    name, model, path = case
    llm = LLM(str(path), cpu_threads=1, page_size=4, num_pages=64, max_prefill_chunk=5)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (7, 3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, ids, 10), name


def test_hf_tokenizer_json_and_bos(tmp_path):
    """A tokenizer.json whose post-processor adds BOS: string prompts get it, text decodes back."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders

    model = make_hf_model("llama")
    model.save_pretrained(tmp_path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(str(tmp_path), cpu_threads=1, page_size=4, num_pages=32)
    out = llm.generate("w5 w17 w300", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out.prompt_token_ids == [1, 5, 17, 300]
    want = hf_greedy(model, [1, 5, 17, 300], 6)
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].text.split() == [f"w{t}" for t in want if t > 2]


def test_generation_config_eos_list(tmp_path):
    """eos_token_id may be a list in generation_config.json (Llama 3); each id stops generation."""
    model = make_hf_model("llama")
    model.save_pretrained(tmp_path)
    ids = [5, 9, 11]
    first = hf_greedy(model, ids, 1)[0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, first]}))
    llm = LLM(str(tmp_path), cpu_threads=1, page_size=4, num_pages=32)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"


def test_bad_hf_directories(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        LLM(str(tmp_path))
    model = make_hf_model("llama")
    model.config.save_pretrained(tmp_path)  # config, no weights
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="cannot read safetensors"):
        LLM(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "nope"))


def test_missing_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model("qwen3").save_pretrained(tmp_path)
    w = load_file(str(tmp_path / "model.safetensors"))
    del w["model.layers.1.self_attn.k_norm.weight"]
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*k_norm"):
        LLM(str(tmp_path))
