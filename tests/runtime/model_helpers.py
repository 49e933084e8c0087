"""Helpers for the runtime model tests: tiny random HF checkpoints and per-position runtime logits."""
from __future__ import annotations

import numpy as np
import torch

from uacompile.runtime.scheduler import ScheduledBatch
from uacompile.runtime.sequence import SamplingParams, Sequence

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2)


def hf_classes(arch: str):
    import transformers as tf

    return {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[arch]


def make_hf_model(arch: str, seed: int = 0, **overrides):
    """A random model with weights large enough that attention is far from uniform."""
    cfg_cls, model_cls = hf_classes(arch)
    cfg = cfg_cls(**{**TINY, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "embed" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 1.5 / p.shape[1] ** 0.5)
    return model


def saved_hf_model(tmp_path_factory, name: str, arch: str, seed: int, **overrides):
    """make_hf_model saved in a fresh temporary folder named after name: (model, path)."""
    model = make_hf_model(arch, seed=seed, **overrides)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return model, path


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    toks = list(ids)
    for _ in range(n):
        toks.append(int(np.argmax(hf_logits(model, toks)[-1])))
    return toks[len(ids):]


def runtime_logits(executor, prompts: list[list[int]], chunks: list[list[int]], rng) -> list[dict[int, np.ndarray]]:
    """Run prompts together through executor.execute, sequence i in chunks[i] (sizes summing to its
    length), on scattered pages. Returns, per prompt, {position: logits} at each chunk's last token."""
    P, num_pages = executor.page_size, executor.kv.shape[2]
    need = [-(-len(p) // P) for p in prompts]
    pool = rng.permutation(num_pages)[:sum(need)].tolist()
    seqs, plans, out = [], [], [dict() for _ in prompts]
    for i, ids in enumerate(prompts):
        assert sum(chunks[i]) == len(ids)
        s = Sequence(i, list(ids), len(ids), SamplingParams())
        s.block_table = pool[sum(need[:i]):sum(need[:i + 1])]
        seqs.append(s)
        plans.append(list(chunks[i]))
    while any(plans):
        live = [i for i in range(len(seqs)) if plans[i]]
        sizes = [plans[i].pop(0) for i in live]
        batch = ScheduledBatch(seqs=[seqs[i] for i in live], num_new_tokens=sizes, sample=[True] * len(live))
        got, logits = executor.execute(batch)
        assert [s.seq_id for s in got] == live
        for i, n, row in zip(live, sizes, logits):
            seqs[i].num_computed_tokens += n
            out[i][seqs[i].num_computed_tokens - 1] = row.double().cpu().numpy()
    return out


def assert_logits_match(model, prompts: list[list[int]], got: list[dict[int, np.ndarray]], rel_tol: float,
                        label: str = "") -> None:
    """Each row of runtime_logits' answer within rel_tol of the largest |logit| of transformers' at that position."""
    for ids, per_pos in zip(prompts, got):
        want = hf_logits(model, ids)
        for pos, row in per_pos.items():
            np.testing.assert_allclose(row, want[pos], atol=rel_tol * np.abs(want[pos]).max(), rtol=0,
                                       err_msg=f"{label}: position {pos}")


def gguf_writer(path, arch: str, cfg):
    """A gguf.GGUFWriter with the model shape's metadata of a HF config written (the GGUF tests' files)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return w


# a 2-layer llama (permuted Q/K rows) whose projections use all six GGUF block formats, runs of formats within the
# fused q/k/v and gate/up, and a tied Q8_0 embedding
EVERY_FORMAT_SHAPE = dict(E=256, F=512, H=4, HKV=2, D=64, V=320)
EVERY_FORMAT_LAYERS = [("q4_k", "q4_k", "q6_k", "q5_k", "q4_0", "q4_1", "q8_0"),
                       ("q8_0", "q6_k", "q6_k", "q4_1", "q5_k", "q5_k", "q4_k")]  # q, k, v, o, gate, up, down


def write_every_format_gguf(path, seed: int = 3, override_type=None):
    """Write the every-format model (random blocks, testing.random_quant_weight) to path; returns path.
    override_type {GGUF tensor name: gguf.GGMLQuantizationType}: that tensor as random bytes of that type instead."""
    from types import SimpleNamespace

    import gguf

    from uacompile import ir, testing

    s = EVERY_FORMAT_SHAPE
    E, F_, H, HKV, D, V = s["E"], s["F"], s["H"], s["HKV"], s["D"], s["V"]
    shapes = {"attn_q": (H * D, E), "attn_k": (HKV * D, E), "attn_v": (HKV * D, E), "attn_output": (E, H * D),
              "ffn_gate": (F_, E), "ffn_up": (F_, E), "ffn_down": (E, F_)}
    rng = np.random.default_rng(seed)
    cfg = SimpleNamespace(max_position_embeddings=256, hidden_size=E, intermediate_size=F_,
                          num_hidden_layers=len(EVERY_FORMAT_LAYERS), num_attention_heads=H, num_key_value_heads=HKV,
                          head_dim=D, rope_parameters={"rope_theta": 10000.0}, rms_norm_eps=1e-5)
    w = gguf_writer(path, "llama", cfg)

    def add(name, fmt, rows, cols, scale=0.05):
        qt = (override_type or {}).get(name)
        if qt is not None:
            block, nbytes = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 256, size=(rows, cols // block * nbytes), dtype=np.uint8)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
            return
        raw = testing.random_quant_weight(rng, fmt, rows, cols, scale)
        w.add_tensor(name, raw, raw_shape=raw.shape,
                     raw_dtype=getattr(gguf.GGMLQuantizationType, ir.WEIGHT_FORMATS[fmt].gguf))

    add("token_embd.weight", "q8_0", V, E, 1.0)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(E)).astype(np.float32))
    for i, formats in enumerate(EVERY_FORMAT_LAYERS):
        for name, fmt in zip(shapes, formats):
            add(f"blk.{i}.{name}.weight", fmt, *shapes[name])
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(E)).astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@torch.inference_mode()
def prompt_logprobs(executor, ids: list[int], chunk: int = 512, kv=None) -> np.ndarray:
    """log p(ids[i + 1] | ids[:i + 1]) for every i, from the runtime's own forward (its kernels, the paged KV
    cache), chunk tokens a step with every row's logits kept (the engine keeps only the sampled rows'): the
    per-token log-probabilities a perplexity needs. Returns float64 [len(ids) - 1]. With kv (the engine's
    KVManager) the pages are taken from it and given back, so an engine that goes on serving (its prefix cache)
    keeps its pages intact; without, the text is written into pages 0, 1, ... of a cache nothing else uses."""
    P = executor.page_size
    s = Sequence(-1, list(ids), len(ids), SamplingParams())
    if kv is None:
        s.block_table = list(range(-(-len(ids) // P)))
        assert len(s.block_table) <= executor.kv.shape[2], "KV cache too small for the text"
        return _prompt_logprobs(executor, s, ids, chunk)
    assert kv.allocate_slots(s, len(ids)) is not None, "KV cache too small for the text"
    try:
        return _prompt_logprobs(executor, s, ids, chunk)
    finally:
        kv.free(s)


def _prompt_logprobs(executor, s, ids: list[int], chunk: int) -> np.ndarray:
    from uacompile.runtime.step import device_step, host_step

    P = executor.page_size
    rows = []
    while s.num_computed_tokens < len(ids):
        n = min(chunk, len(ids) - s.num_computed_tokens)
        executor.staging.flip()
        hs = host_step(ScheduledBatch(seqs=[s], num_new_tokens=[n], sample=[True]), P)
        step = device_step(hs, executor.staging)
        plan = executor.kernels.plan_step(len(hs.input_ids), len(hs.page_table), hs.page_table.shape[1] * P)
        rows.append(torch.log_softmax(executor.model.logits(executor.forward(step, plan)).double(), -1).cpu())
        s.num_computed_tokens += n
    lp = torch.cat(rows)[:-1]
    return lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1))[:, 0].numpy()


def causal_attention(layer, q, k, v):
    """One sequence's causal attention over [T, H, D] in torch (GQA by repeating K/V heads): the executor's attention
    callback for a model run outside the engine."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True)
    return out.transpose(0, 1).contiguous()


def model_logits(model, ids: list[int], device="cpu") -> np.ndarray:
    """The model's logits [T, V] (float64, on the host) over one sequence, with causal_attention."""
    t = torch.tensor(ids, device=device)
    with torch.inference_mode():
        return model.logits(model(t, torch.arange(len(ids), device=device), causal_attention)).double().cpu().numpy()
