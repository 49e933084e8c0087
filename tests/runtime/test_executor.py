"""executor.py's 8-bit KV cache on stories260K (tvm-cpu): the scales live beside the pages, [num_layers, 2, pages, P,
Hkv] float32 on the device and in the swap pool, and go wherever a page goes: copy-on-write for n > 1 samples, swap
preemption out to the host pool and back, saves to the CPU offload tier and restores from it, compaction, and
prefix-cache sharing (a shared page is one page id, so its scales are shared with it). Each check spies on the backend's page moves and compares the scales after the move, then checks
the tokens against an engine where the move never happens."""
import pytest
import torch

from uacompile.models import STORIES260K
from uacompile.runtime import LLM, SamplingParams
from uacompile.runtime.engine import Engine, EngineConfig
from uacompile.runtime.loader import LoadedModel
from uacompile.runtime.model import ModelConfig

QUANT = ["int8", "fp8_e4m3"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["Once upon a time", "Tom and his dog went to the park. They saw a big tree and a little bird.", [1],
           "Lily liked to", "The sun was hot and the sky was blue. Lily and Tom went to the beach", "One day"]


def make(kv, **kw):
    return LLM(STORIES260K, cpu_threads=1, kv_cache_dtype=kv, **{"page_size": 4, **kw})


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def page_bytes(t: torch.Tensor, pages) -> torch.Tensor:
    """The raw bytes of pages of a [L, 2, pages, ...] tensor (fp8 compared bit for bit)."""
    return t[:, :, list(pages)].contiguous().view(torch.uint8)


def spy_moves(llm, method: str) -> list:
    """After each call of the backend's copy_blocks / swap_blocks: whether every moved page's K/V bytes and scales
    equal its source's, and whether the moved scales were written (non-zero) at all."""
    kernels, checks = llm.engine.kernels, []
    real = getattr(kernels, method)

    def spy(**kw):
        real(**kw)
        m = kw["mapping"].tolist()
        src, dst = [s for s, _ in m], [d for _, d in m]
        if method == "copy_blocks":
            (kv_s, kv_d), (sc_s, sc_d) = (kw["kv"], kw["kv"]), (kw["scales"], kw["scales"])
        else:
            (kv_s, kv_d), (sc_s, sc_d) = (kw["src"], kw["dst"]), (kw["src_scales"], kw["dst_scales"])
        checks.append((torch.equal(page_bytes(kv_s, src), page_bytes(kv_d, dst)),
                       torch.equal(sc_s[:, :, src], sc_d[:, :, dst]), bool(sc_d[:, :, dst].abs().sum() > 0)))

    setattr(kernels, method, spy)
    return checks


@pytest.mark.parametrize("kv", QUANT)
def test_scales_are_allocated_beside_the_pages(kv):
    llm = make(kv, num_pages=30, num_cpu_pages=7, preemption="swap")
    ex, cfg = llm.engine.executor, llm.engine.model.cfg
    L, Hkv, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    assert ex.kv.dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv]
    assert ex.kv.shape == (L, 2, 30, 4, Hkv, D) and ex.scales.shape == (L, 2, 30, 4, Hkv)
    assert ex.cpu_kv.shape == (L, 2, 7, 4, Hkv, D) and ex.cpu_scales.shape == (L, 2, 7, 4, Hkv)
    assert ex.scales.dtype == ex.cpu_scales.dtype == torch.float32
    assert llm.engine.kernels.ops.quantized and llm.engine.kernels.ops.kv_dtype == kv
    plain = LLM(STORIES260K, cpu_threads=1, page_size=4, num_pages=30)
    assert plain.engine.executor.scales is None and plain.engine.executor.kv.dtype == torch.float32


@pytest.mark.parametrize("num_kv_heads,page_size,num_pages,allocated", [(4, 1, 31, 31), (1, 1, 31, 32), (1, 2, 31, 32),
                                                                         (1, 4, 31, 31), (2, 1, 29, 30)])
def test_pages_are_padded_so_each_layers_scales_start_aligned(num_kv_heads, page_size, num_pages, allocated):
    """Each layer's K and V scales start 16-byte aligned (the CUDA kernels' rule for every data tensor): where
    P * Hkv * pages is not a multiple of 4 floats the pool gets spare pages, which the KV manager never hands out."""
    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=4,
                      num_kv_heads=num_kv_heads, head_dim=8, max_position_embeddings=64)
    eng = Engine(LoadedModel(cfg, None, None), EngineConfig(kernel_backend="reference", kv_cache_dtype="int8",
                                                            progress=False), page_size=page_size, num_pages=num_pages)
    ex = eng.executor
    assert eng.scheduler.kv.num_pages == num_pages
    assert ex.kv.shape[2] == ex.scales.shape[2] == allocated
    assert all(ex.scales[layer, i].data_ptr() % 16 == 0 for layer in range(3) for i in range(2))


@pytest.mark.parametrize("kv", QUANT)
def test_copy_on_write_copies_the_scales(kv):
    """n = 2 greedy samples share the prompt's pages; the last, partial one is copied on write, scales with it.
    Both samples then give the n = 1 tokens of the same cache (a copy without its scales would zero those slots)."""
    llm = make(kv)
    prompt = "Tom and his dog went to the park."
    want = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    checks = spy_moves(llm, "copy_blocks")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2))[0]
    assert checks and all(all(c) for c in checks), checks
    assert [c.token_ids for c in out.outputs] == [want, want]


@pytest.mark.parametrize("kv", QUANT)
def test_swap_preemption_moves_the_scales_out_and_back(kv):
    """24 pages of 4 tokens cannot hold the six sequences at once: they are swapped to the host pool and back,
    scales too, and give the tokens of a pool with room for all."""
    want = tokens(make(kv, num_pages=256).generate(PROMPTS, GREEDY))
    llm = make(kv, num_pages=24, num_cpu_pages=64, preemption="swap", max_model_len=96)
    checks = spy_moves(llm, "swap_blocks")
    got = tokens(llm.generate(PROMPTS, GREEDY))
    assert llm.engine.scheduler.num_preemptions > 0
    assert len(checks) >= 2 and all(all(c) for c in checks), checks  # out and back in, every page's bytes
    assert got == want


@pytest.mark.parametrize("kv", QUANT)
def test_prefix_cache_pages_carry_their_scales(kv):
    """A second request on a cached prefix attends the first one's pages as they are (one page id, its scales
    with it: nothing rewrites them) and gives the tokens of an engine without the prefix cache."""
    shared = "Once upon a time, there was a little girl named Lily. She liked to play outside."
    tails = [" One day", " Her mom said"]
    base = make(kv, enable_prefix_caching=False)
    want = [base.generate([shared + t], GREEDY)[0].outputs[0].token_ids for t in tails]
    llm = make(kv)
    eng = llm.engine
    got = [llm.generate([shared + tails[0]], GREEDY)[0].outputs[0].token_ids]
    cached = sorted(eng.scheduler.kv.lru)  # the first request's full pages, kept for reuse
    before = eng.executor.scales[:, :, cached].clone()
    assert cached and before.abs().sum() > 0
    got.append(llm.generate([shared + tails[1]], GREEDY)[0].outputs[0].token_ids)
    assert eng.scheduler.kv.prefix_hit_tokens > 0
    assert torch.equal(eng.executor.scales[:, :, cached], before)  # attended, never rewritten
    assert got == want


@pytest.mark.parametrize("kv", QUANT)
def test_the_offload_tier_keeps_the_scales_beside_its_pages(kv):
    """Running sequences' pages are saved to the offload tier (its own scales tensor) and restored after their
    preemption, scales with them, and give the tokens of a pool with room for all."""
    want = tokens(make(kv, num_pages=256).generate(PROMPTS, GREEDY))
    llm = make(kv, num_pages=24, max_model_len=96, preemption="offload", num_offload_pages=96, offload_watermark=0)
    ex, cfg = llm.engine.executor, llm.engine.model.cfg
    assert ex.offload_kv.shape == (cfg.num_layers, 2, 96, 4, cfg.num_kv_heads, cfg.head_dim)
    assert ex.offload_scales.shape == (cfg.num_layers, 2, 96, 4, cfg.num_kv_heads)
    checks = spy_moves(llm, "swap_blocks")
    got = tokens(llm.generate(PROMPTS, GREEDY))
    st = llm.engine.scheduler.stats()
    assert st["num_preemptions"] > 0 and st["pages_offloaded"] > 0 and st["pages_restored"] > 0
    assert len(checks) >= 2 and all(all(c) for c in checks), checks
    assert got == want


@pytest.mark.parametrize("kv", QUANT)
def test_compaction_moves_the_scales_with_the_pages(kv):
    """Past a fragmentation of 0.05 the cache is compacted between steps (copy_blocks), scales with the pages; the
    tokens are those of an engine that never compacts."""
    kw = dict(num_pages=64, max_num_batched_tokens=16, max_prefill_chunk=16)
    want = tokens(make(kv, compact_threshold=None, **kw).generate(PROMPTS, GREEDY))
    llm = make(kv, compact_threshold=0.05, compact_min_holes=1, **kw)
    checks = spy_moves(llm, "copy_blocks")
    got = tokens(llm.generate(PROMPTS, GREEDY))
    assert llm.engine.scheduler.num_compactions > 0 and checks and all(all(c) for c in checks), checks
    assert got == want
