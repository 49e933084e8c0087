"""memory.py's page_bytes and the engine's pool sized from it: a KV budget is bytes, and an 8-bit page (its
elements and their float32 scales) costs about half a 16-bit one, so the same budget buys about twice the pages;
num_pages given explicitly still means pages."""
import pytest

from uacompile.models import STORIES260K
from uacompile.runtime import LLM
from uacompile.runtime.engine import Engine, EngineConfig
from uacompile.runtime.loader import LoadedModel
from uacompile.runtime.memory import page_bytes
from uacompile.runtime.model import ModelConfig


def test_page_bytes_counts_elements_and_scales():
    # Qwen3-8B: 36 layers, 8 KV heads, head_dim 128, pages of 16
    assert page_bytes(36, 8, 128, 16, "bf16") == 36 * 2 * 16 * 8 * 128 * 2
    assert page_bytes(36, 8, 128, 16, "fp32") == 36 * 2 * 16 * 8 * 128 * 4
    for kv in ("int8", "fp8_e4m3"):
        assert page_bytes(36, 8, 128, 16, kv) == 36 * 2 * 16 * 8 * (128 + 4)
    assert page_bytes(36, 8, 128, 16, "bf16") / page_bytes(36, 8, 128, 16, "int8") == pytest.approx(1.94, abs=0.01)
    assert page_bytes(1, 1, 64, 1, "fp16") / page_bytes(1, 1, 64, 1, "fp8_e4m3") == pytest.approx(1.88, abs=0.01)


def random_engine(kv: str, **kw) -> Engine:
    """A head_dim-128 model of random weights on the reference backend (nothing to build), fp16."""
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=256, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=128, max_position_embeddings=4096)
    ec = EngineConfig(dtype="float16", kernel_backend="reference", kv_cache_dtype=kv, progress=False,
                      kv_cache_bytes=kw.pop("kv_cache_bytes", None))
    return Engine(LoadedModel(cfg, None, None), ec, **kw)


def pool_bytes(eng: Engine) -> int:
    ex = eng.executor
    return ex.kv.nbytes + (ex.scales.nbytes if ex.scales is not None else 0)


@pytest.mark.parametrize("budget", [1 << 20, 3_000_000])
def test_the_same_budget_buys_about_twice_the_pages_in_8_bits(budget):
    pages = {kv: random_engine(kv, kv_cache_bytes=budget, page_size=16) for kv in ("auto", "int8", "fp8_e4m3")}
    per_page = {kv: page_bytes(2, 1, 128, 16, "fp16" if kv == "auto" else kv) for kv in pages}
    for kv, eng in pages.items():
        assert eng.scheduler.kv.num_pages == budget // per_page[kv]
        assert budget - per_page[kv] < pool_bytes(eng) <= budget  # the pool, scales included, fills the budget
    ratio = pages["int8"].scheduler.kv.num_pages / pages["auto"].scheduler.kv.num_pages
    assert ratio == pytest.approx(256 / 132, rel=0.02)
    assert pages["fp8_e4m3"].scheduler.kv.num_pages == pages["int8"].scheduler.kv.num_pages


def test_num_pages_given_means_pages_whatever_the_dtype():
    for kv in ("auto", "int8", "fp8_e4m3"):
        eng = random_engine(kv, num_pages=40, page_size=16)
        assert eng.scheduler.kv.num_pages == 40 and eng.executor.kv.shape[2] == 40


def test_stories_pool_from_kv_cache_bytes():
    """stories260K (5 layers, 4 KV heads, head_dim 8) in float32: a page of 4 slots is 5 * 2 * 4 * 4 * 32 bytes
    in float32 and 5 * 2 * 4 * 4 * (8 + 4) in 8 bits: 2.67 times the pages."""
    budget = 200_000
    got = {kv: LLM(STORIES260K, cpu_threads=1, page_size=4, kv_cache_bytes=budget, kv_cache_dtype=kv)
           .engine.scheduler.kv.num_pages for kv in ("auto", "int8")}
    assert got == {"auto": budget // (5 * 2 * 4 * 4 * 32), "int8": budget // (5 * 2 * 4 * 4 * 12)}


def test_a_budget_below_one_page_names_the_cache_dtype():
    with pytest.raises(ValueError, match=r"holds no KV page: .* \(KV in int8\)$"):
        random_engine("int8", kv_cache_bytes=1000, page_size=16)
