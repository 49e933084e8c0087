"""stories260K (a real GGUF) against references written apart from the runtime:
a plain numpy Llama that reads the GGUF tensors itself (llama.cpp's interleaved RoPE on the
stored Q/K rows, no un-permute), and transformers' GGUF tokenizer."""
import numpy as np
import pytest

from uacompile.runtime import LLM, SamplingParams
from uacompile.models import STORIES260K

STORY_START = "Once upon a time, there was a little girl named Lily."  # the model card's greedy story


@pytest.fixture(scope="module")
def stories_path():
    return STORIES260K  # shipped in the package: a missing file fails, never skips


class NumpyLlama:
    """float64 Llama straight from GGUF tensors: interleaved-pair RoPE, GQA, SwiGLU, full recompute."""

    def __init__(self, path):
        import gguf

        r = gguf.GGUFReader(str(path))
        meta = {k: f.contents() for k, f in r.fields.items()}
        self.w = {t.name: np.asarray(t.data, dtype=np.float64).reshape(tuple(reversed([int(d) for d in t.shape])))
                  for t in r.tensors}
        self.n_layers = meta["llama.block_count"]
        self.H, self.Hkv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
        self.eps = meta["llama.attention.layer_norm_rms_epsilon"]
        self.base = meta.get("llama.rope.freq_base", 10000.0)
        self.D = meta["llama.embedding_length"] // self.H

    def norm(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def rope(self, x):  # x [T, H, D]; pairs (2i, 2i+1) rotate by pos * base^(-2i/D)
        T, D = x.shape[0], x.shape[-1]
        ang = np.arange(T)[:, None] * self.base ** (-np.arange(0, D, 2) / D)[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
        return out

    def logits(self, tokens):
        w, T, D = self.w, len(tokens), self.D
        x = w["token_embd.weight"][tokens]
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for i in range(self.n_layers):
            b = lambda n: w[f"blk.{i}.{n}.weight"]  # noqa: E731
            h = self.norm(x, b("attn_norm"))
            q = self.rope((h @ b("attn_q").T).reshape(T, self.H, D))
            k = self.rope((h @ b("attn_k").T).reshape(T, self.Hkv, D))
            v = (h @ b("attn_v").T).reshape(T, self.Hkv, D)
            rep = self.H // self.Hkv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + mask
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            x = x + np.einsum("hts,shd->thd", p, v).reshape(T, -1) @ b("attn_output").T
            h = self.norm(x, b("ffn_norm"))
            g = h @ b("ffn_gate").T
            x = x + ((g / (1 + np.exp(-g))) * (h @ b("ffn_up").T)) @ b("ffn_down").T
        out = w.get("output.weight", w["token_embd.weight"])
        return self.norm(x[-1], w["output_norm.weight"]) @ out.T

    def greedy(self, prompt, n):
        toks = list(prompt)
        for _ in range(n):
            toks.append(int(np.argmax(self.logits(toks))))
        return toks[len(prompt):]


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), cpu_threads=1)


@pytest.mark.parametrize("prompt", [[1], "Once upon a time", "Tom and his dog went to the park"])
def test_greedy_matches_numpy_reference(llm, stories_path, prompt):
    ref = NumpyLlama(stories_path)
    ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    want = ref.greedy(ids, 40)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert got.prompt_token_ids == ids
    assert got.outputs[0].token_ids == want


def test_story_from_bos_reads_like_the_model_card(llm):
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert out.text.startswith(STORY_START), out.text


def test_reference_kernel_backend_agrees(stories_path, llm):
    ref_llm = LLM(str(stories_path), kernel_backend="reference", cpu_threads=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Lily wanted", [1, 403, 407]]
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params)]
    assert a == b


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_matches_transformers_gguf_tokenizer(stories_path, tmp_path, llm):
    """transformers' own GGUF tokenizer is the reference. It chokes on the file's padding id
    (0xFFFFFFFF), so the test rewrites the vocab into a fresh GGUF without it."""
    import gguf
    import transformers
    meta = {k: f.contents() for k, f in gguf.GGUFReader(str(stories_path)).fields.items()}
    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0)
    for add, v in ((w.add_context_length, 2048), (w.add_embedding_length, 64), (w.add_block_count, 1),
                   (w.add_head_count, 8), (w.add_feed_forward_length, 172)):
        add(v)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="vocab.gguf")
    tok = llm.tokenizer
    texts = ["Once upon a time", "Hello world", "Lily's dog ran!  Two  spaces\nnew line", "héllo 😀 ~ é",
             "The quick brown fox jumped over the lazy dog.", "trailing  ", "", "x"]
    for text in texts:
        assert tok.encode(text) == ref(text).input_ids, text
        assert tok.decode(tok.encode(text)) == text


def test_tokenizer_llama_cpp_rules(llm):
    tok = llm.tokenizer
    # llama.cpp always prefixes a space, even before a leading space (transformers' Metaspace does not)
    assert [tok.tokens[t] for t in tok.encode(" a")[1:]] == ["\u2581", "\u2581a"]
    assert tok.encode("a", add_special_tokens=False)[0] != tok.bos_token_id
    # a character outside the vocab falls back to its UTF-8 bytes
    assert [tok.tokens[t] for t in tok.encode("\u4e2d", add_special_tokens=False)[1:]] == ["<0xE4>", "<0xB8>", "<0xAD>"]
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")


def test_story_text_round_trips_through_the_tokenizer(llm):
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))[0].outputs[0]
    ids = [t for t in out.token_ids if t not in (1, 2)]
    text = llm.tokenizer.decode(ids)
    assert llm.tokenizer.encode(text, add_special_tokens=False) == ids
