"""GGUF loading: a tiny random Llama written here as GGUF the way llama.cpp's converter does it
(Q/K rows permuted for interleaved RoPE; F32, F16, BF16 and Q8_0 tensors), checked against a
Q8_0/BF16 decode written in this file and against transformers running the same weights."""
import numpy as np
import pytest
import torch

import gguf
import transformers  # noqa: F401

from model_helpers import assert_logits_match, gguf_writer, hf_greedy, hf_logits, make_hf_model, runtime_logits  # noqa: E402

from uacompile.runtime import LLM, SamplingParams  # noqa: E402
from uacompile.models import STORIES260K  # noqa: E402
from uacompile.runtime.loader import load  # noqa: E402

Q = gguf.GGMLQuantizationType
# HF name suffix -> (GGUF name, storage type)
LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm.weight", Q.F32),
    "self_attn.q_proj.weight": ("attn_q.weight", Q.Q8_0),
    "self_attn.k_proj.weight": ("attn_k.weight", Q.BF16),
    "self_attn.v_proj.weight": ("attn_v.weight", Q.F16),
    "self_attn.o_proj.weight": ("attn_output.weight", Q.Q8_0),
    "post_attention_layernorm.weight": ("ffn_norm.weight", Q.F32),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q.Q8_0),
    "mlp.up_proj.weight": ("ffn_up.weight", Q.F16),
    "mlp.down_proj.weight": ("ffn_down.weight", Q.Q8_0),
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's permute: per head, rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def decode_q8_0(raw: np.ndarray, shape) -> np.ndarray:
    """Q8_0 by hand: blocks of 34 bytes = fp16 scale, then 32 int8 values."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    vals = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (scale * vals).reshape(shape)


def decode_bf16(raw: np.ndarray, shape) -> np.ndarray:
    bits = np.asarray(raw).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32).reshape(shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs for Llama 3 rope scaling (one factor per pair)."""
    inv = rope["rope_theta"] ** (-np.arange(0, head_dim, 2) / head_dim)
    old, lo, hi, f = (rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"],
                      rope["factor"])
    out = []
    for wavelen in 2 * np.pi / inv:
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(f)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / f + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path, model, vocab_meta: dict | None, tied=False, arch="llama", override_type=None, drop=(),
               rope_freqs=None):
    """Write model as GGUF; returns {gguf name: (raw stored array, type)}."""
    cfg = model.config
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf_writer(path, arch, cfg)
    if vocab_meta:
        w.add_tokenizer_model("llama")
        w.add_token_list(vocab_meta["tokenizer.ggml.tokens"])
        w.add_token_scores(vocab_meta["tokenizer.ggml.scores"])
        w.add_token_types(vocab_meta["tokenizer.ggml.token_type"])
        w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0)
    tensors = {"token_embd.weight": (sd["model.embed_tokens.weight"], Q.F16),
               "output_norm.weight": (sd["model.norm.weight"], Q.F32)}
    if not tied:
        tensors["output.weight"] = (sd["lm_head.weight"], Q.Q8_0)
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = (rope_freqs, Q.F32)
    for i in range(cfg.num_hidden_layers):
        for hf, (name, qt) in LAYER_TENSORS.items():
            x = sd[f"model.layers.{i}.{hf}"]
            if "q_proj" in hf:
                x = llama_cpp_permute(x, H)
            elif "k_proj" in hf:
                x = llama_cpp_permute(x, Hkv)
            tensors[f"blk.{i}.{name}"] = (x, qt)
    stored = {}
    for name, (x, qt) in tensors.items():
        if name in drop:
            continue
        qt = override_type.get(name, qt) if override_type else qt
        if qt == Q.F32:
            raw = x.astype(np.float32)
            w.add_tensor(name, raw)
        elif qt == Q.F16:
            raw = x.astype(np.float16)
            w.add_tensor(name, raw)
        else:
            raw = gguf.quants.quantize(x.astype(np.float32), qt)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
        stored[name] = (raw, qt, x.shape)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return stored


def decoded(stored_entry) -> np.ndarray:
    raw, qt, shape = stored_entry
    if qt == Q.Q8_0:
        return decode_q8_0(raw, shape)
    if qt == Q.BF16:
        return decode_bf16(raw, shape)
    return raw.astype(np.float32)


def unpermute_by_index(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama_cpp_permute, written row by row: HF row (h, half, i) <- GGUF row (h, 2i + half)."""
    D = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(D // 2):
            out[h * D + i] = w[h * D + 2 * i]
            out[h * D + D // 2 + i] = w[h * D + 2 * i + 1]
    return out


@pytest.fixture(scope="module")
def vocab_meta():
    path = STORIES260K  # any 512-token llama vocab would do; this is the one shipped
    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def written(tmp_path_factory, vocab_meta):
    model = make_hf_model("llama", seed=3)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    stored = write_gguf(path, model, vocab_meta)
    # the reference model runs exactly the dequantised weights
    ref = make_hf_model("llama", seed=3)
    H, Hkv = ref.config.num_attention_heads, ref.config.num_key_value_heads
    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(torch.from_numpy(decoded(stored["token_embd.weight"])))
        ref.lm_head.weight.copy_(torch.from_numpy(decoded(stored["output.weight"])))
        for i in range(ref.config.num_hidden_layers):
            layer = ref.model.layers[i]
            for hf, (name, _) in LAYER_TENSORS.items():
                x = decoded(stored[f"blk.{i}.{name}"])
                x = unpermute_by_index(x, H) if "q_proj" in hf else unpermute_by_index(x, Hkv) if "k_proj" in hf else x
                layer.get_parameter(hf).copy_(torch.from_numpy(x))
    return path, stored, model, ref


def test_dequantised_weights_match_hand_decode(written):
    path, stored, original, ref = written
    loaded = load(path)
    want = ref.state_dict()
    assert {k for k in loaded.weights} == {k for k in want}
    for name, w in loaded.weights.items():
        np.testing.assert_array_equal(w.numpy(), want[name].numpy(), err_msg=name)
    # and the decode is close to the unquantised original (a wrong decode would not be)
    q = loaded.weights["model.layers.0.self_attn.q_proj.weight"].numpy()
    orig = original.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert np.abs(q - orig).max() < 0.02 * np.abs(orig).max()
    assert {stored[n][1] for n in stored} == {Q.F32, Q.F16, Q.BF16, Q.Q8_0}


def test_gguf_logits_match_transformers(written, rng):
    path, _, _, ref = written
    llm = LLM(str(path), cpu_threads=1, page_size=4, num_pages=64)
    assert llm.engine.model.cfg.tie_word_embeddings is False
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (11, 5)]
    got = runtime_logits(llm.engine.executor, prompts, [[4, 4, 1, 1, 1], [1, 1, 3]], rng)
    assert_logits_match(ref, prompts, got, 2e-4, "gguf")


def test_gguf_tied_embeddings_and_tokenizer(tmp_path, vocab_meta):
    model = make_hf_model("llama", seed=5, tie_word_embeddings=True)
    path = tmp_path / "tied.gguf"
    write_gguf(path, model, vocab_meta, tied=True,
               override_type={n: Q.F32 for n in ["token_embd.weight"] + [f"blk.{i}.{v[0]}" for i in range(2)
                                                                      for v in LAYER_TENSORS.values()]})
    llm = LLM(str(path), cpu_threads=1, page_size=4, num_pages=64)
    assert llm.engine.model.cfg.tie_word_embeddings
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.prompt_token_ids == [1, 403, 407, 261, 378]  # BOS + llama.cpp SPM pieces
    assert out.outputs[0].token_ids == hf_greedy(model, out.prompt_token_ids, 8)


def test_gguf_rope_freqs_match_llama3_scaling(tmp_path, rng):
    """Llama 3 GGUFs carry rope scaling as a rope_freqs tensor (llama.cpp divides each frequency by it)."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = make_hf_model("llama", seed=9, rope_parameters=rope)
    path = tmp_path / "llama3.gguf"
    factors = llama3_rope_factors(rope, model.config.head_dim)
    assert (factors != 1).any()
    all_f32 = {f"blk.{i}.{v[0]}": Q.F32 for i in range(2) for v in LAYER_TENSORS.values()}
    write_gguf(path, model, None, override_type={"output.weight": Q.F32, "token_embd.weight": Q.F32, **all_f32},
               rope_freqs=factors)
    llm = LLM(str(path), cpu_threads=1, page_size=4, num_pages=32)
    ids = rng.integers(3, 512, size=12).tolist()
    got = runtime_logits(llm.engine.executor, [ids], [[7, 5]], rng)[0]
    want = hf_logits(model, ids)
    for pos, row in got.items():
        np.testing.assert_allclose(row, want[pos], atol=2e-4 * np.abs(want[pos]).max(), rtol=0)


def test_corrupt_and_unsupported_gguf(tmp_path, written, vocab_meta):
    path, _, model, _ = written
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load(bad)
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated|not a readable GGUF|corrupt"):
        load(cut)
    other = tmp_path / "gpt2.gguf"
    write_gguf(other, model, vocab_meta, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load(other)
    q5 = tmp_path / "q5_0.gguf"  # a type the gguf library writes and this loader does not take
    write_gguf(q5, model, vocab_meta, override_type={"blk.0.ffn_gate.weight": Q.Q5_0})
    with pytest.raises(ValueError, match=r"blk.0.ffn_gate.weight: type Q5_0 is not supported \(supported: .*Q4_K"):
        load(q5)
    missing = tmp_path / "missing.gguf"
    write_gguf(missing, model, vocab_meta, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match="missing tensors.*layers.1.mlp.up_proj"):
        LLM(str(missing))
