"""Decode-only kernels (AttentionConfig.decode_only): every token is its own decode item, no prefill path.

plan() (choose_config) takes them for launches of at most one token a sequence (a decode step). Checked
against the float64 reference with poisoned outputs: 16-bit and quantised KV, head dims 64 to 256, GQA 1
to 16, pages of 1 to 64 positions, window, soft-cap, ALiBi, unified_masked, 1 to 32 splits. A decode-only
kernel is exact for any ubatch, so mixed ubatches with prefill chunks run through it too (each token of a
chunk then streams its own K/V). The call function's choice and a captured graph replay close it.
"""
from __future__ import annotations

import pytest

from uacompile import ir, testing
from uacompile.targets.cuda import attention
from uacompile.targets.cuda.config import AttentionConfig
from uacompile.targets.cuda.plan import choose_splits, device_arch, device_sms

torch = pytest.importorskip("torch")
from cuda_helpers import cuda_api_with, pa_kernel  # noqa: E402
from test_cuda_attention_gpu import device_inputs  # noqa: E402
from test_cuda_decode_gpu import MIXED, fused, replay_on_fresh_inputs, run_and_check  # noqa: E402

gpu = pytest.mark.gpu
PA = ir.PagedAttention

OPS = {
    "bf16-d128-g4": PA(32, 8, 128, 16, "bf16", "bf16", return_lse=True),
    "fp16-d64-g1-p1": PA(8, 8, 64, 1, "fp16", "fp16"),
    "fp16-d80-g8-p32": PA(16, 2, 80, 32, "fp16", "fp16", return_lse=True),
    "bf16-d96-g16-p64": PA(16, 1, 96, 64, "bf16", "bf16"),
    "bf16-d256-g2": PA(8, 4, 256, 16, "bf16", "bf16", return_lse=True),
    "int8-bf16-d128-g4": PA(32, 8, 128, 16, "bf16", "int8", return_lse=True),
    "fp8-fp16-d64-g8-p32": PA(16, 2, 64, 32, "fp16", "fp8_e4m3", return_lse=True),
    "int8-fp16-d80-g4": PA(8, 2, 80, 16, "fp16", "int8"),  # the dequantising pass (not a raw-stage head dim)
    "fp8-bf16-d256-g4": PA(16, 4, 256, 16, "bf16", "fp8_e4m3"),
}
OPTIONS = {
    "window-softcap-alibi-int8": PA(8, 4, 64, 16, "fp16", "int8", window=700, softcap=10.0, alibi=True, return_lse=True),
    "window-bf16": PA(8, 2, 128, 16, "bf16", "bf16", window=300, return_lse=True),
    "unified-fp8": PA(8, 2, 128, 16, "bf16", "fp8_e4m3", variant="unified_masked"),
}
SPLITS = (1, 3, 32)
OPTION_CASES = [("window-softcap-alibi-int8", 1), ("window-softcap-alibi-int8", 7), ("window-bf16", 1),
                ("window-bf16", 16), ("unified-fp8", 1)]
# 1 position, page edges, a stage edge (64, 65), long
DECODE_LENS = [1, 16, 17, 33, 64, 65, 5000, 2900]


def only(op):
    """op's decode-only kernel."""
    return pa_kernel(op, decode_only=True)


def _ops():
    ops = [fused(only(op), s) for op in OPS.values() for s in SPLITS]
    ops += [fused(only(OPTIONS[name]), s) for name, s in OPTION_CASES]
    return list(dict.fromkeys(ops))


@pytest.fixture(scope="module")
def api():
    return cuda_api_with(_ops())


@gpu
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("name", list(OPS))
def test_decode_only_matches_reference(api, rng, name, splits):
    op = OPS[name]
    run_and_check(api, f"{name}/s{splits}", only(op), splits, testing.attention_inputs(op, rng, DECODE_LENS))


@gpu
@pytest.mark.parametrize("name,splits", OPTION_CASES)
def test_decode_only_with_options(api, rng, name, splits):
    op = OPTIONS[name]
    run_and_check(api, f"{name}/s{splits}", only(op), splits, testing.attention_inputs(op, rng, [2000, 299, 300, 301, 5, 900]))


@gpu
@pytest.mark.parametrize("splits", (1, 3))
@pytest.mark.parametrize("name", ["bf16-d128-g4", "int8-bf16-d128-g4", "fp16-d80-g8-p32"])
def test_decode_only_is_exact_for_mixed_ubatches(api, rng, name, splits):
    """Prefill chunks, interleaved tokens: every token a decode item of its own visible range."""
    op = OPS[name]
    run_and_check(api, f"mixed/{name}/s{splits}", only(op), splits, testing.attention_inputs(op, rng, **MIXED))
    inputs = testing.attention_inputs(op, rng, kv_lens=[300, 40, 7], q_lens=[3, 40, 2])
    perm = rng.permutation(inputs["num_tokens"])  # tokens of a sequence apart from each other
    for key in ("q", "token_seq", "token_kv_len"):
        inputs[key] = inputs[key][perm]
    run_and_check(api, f"interleaved/{name}/s{splits}", only(op), splits, inputs)


@gpu
@pytest.mark.parametrize("name", ["bf16-d128-g4", "int8-bf16-d128-g4"])
def test_call_function_launches_decode_only_and_replays_in_a_graph(rng, name):
    """paged_attention() on a decode step takes the decode-only kernel (its split rule on that layout) and, with a
    kept Workspace, is graph capturable: two replays on fresh inputs against the reference."""
    from uacompile.targets.cuda import api as cuda_api

    op = OPS[name]
    lens = [6000, 700, 3000, 1]
    inputs = testing.attention_inputs(op, rng, lens)
    dev = device_inputs(op, inputs)
    launched = []
    kernel_of = lambda k: (launched.append(k), cuda_api.kernel(k))[1]  # the real kernel, the kernel recorded  # noqa: E731
    out = torch.empty_like(dev["q"])
    lse = torch.empty(dev["q"].shape[:2], device="cuda")
    scales = {k: dev[k] for k in ("k_scale", "v_scale") if k in dev}
    args = {k: dev[k] for k in ("q", "k_cache", "v_cache", "token_seq", "page_table", "token_kv_len")}
    stream = torch.cuda.Stream()
    ws = attention.Workspace(dev["q"].device)
    graph = cuda_api.capture_graph([lambda: attention.paged_attention(op, **args, **scales, out=out, lse=lse,
                                                                      workspace=ws, kernel_of=kernel_of)], stream=stream)
    assert launched and all(k.config.decode_only and k.op == op for k in launched)
    splits = launched[-1].config.num_splits
    index = dev["q"].device.index if dev["q"].device.index is not None else torch.cuda.current_device()
    assert splits == choose_splits(op, AttentionConfig(decode_only=True), len(lens), len(lens),
                                   dev["page_table"].shape[1] * op.page_size, device_sms(index), device_arch(index))
    assert splits > 1 and launched[-1].config.fused_merge  # the fused merge's counters are part of what the replays check
    counters = ws.counters(len(lens), op.num_kv_heads)

    def fresh():  # fresh q and K/V; the scales stay (the replay copies q, K and V only)
        new = testing.attention_inputs(op, rng, lens)
        return {**new, **{k: inputs[k] for k in ("k_scale", "v_scale") if k in inputs}}
    replay_on_fresh_inputs("replay", graph, op, dev, inputs, fresh, out, lse, counters)
