"""Plan once, run many (attention.plan / attention.run) against the float64 reference on the GPU.

A step is planned once from its shapes and run over several layers' caches (fresh random q, K and V per layer,
the step's page table and token layout shared), outputs poisoned with NaN before each run: decode steps, whole
prompts and mixed ubatches, one split and several (merged in the same launch or by merge_state), 16-bit and
int8 KV. Plans share one Workspace across layers and with each other, leaving its counters and item queue
zero; a CUDA graph captured over run() follows its inputs (q, K/V, page table, kv lengths) changed in place.
"""
from __future__ import annotations

import numpy as np
import pytest

from uacompile import ir, testing
from uacompile.targets.cuda import attention
from uacompile.targets.cuda.plan import choose_config, device_arch, device_sms

torch = pytest.importorskip("torch")
from cuda_helpers import cuda_api_with  # noqa: E402
from test_cuda_attention_gpu import device_inputs, to_dev  # noqa: E402
from test_cuda_decode_gpu import check_outputs  # noqa: E402

gpu = pytest.mark.gpu
PA = ir.PagedAttention
OPS = {
    "bf16": PA(32, 8, 128, 16, "bf16", "bf16", return_lse=True),  # the benchmarks' shape (Hopper prefill path)
    "int8": PA(8, 2, 128, 16, "fp16", "int8", return_lse=True),  # quantised KV: the scales pass through run()
}
STEPS = {  # kv_lens, q_lens of a step
    "decode": ([3000, 700, 1, 5000, 64], None),
    "prefill": ([700, 300, 45], [700, 300, 45]),
    "mixed": ([37, 3000, 129, 1, 640, 2515], [1, 45, 1, 1, 64, 1]),
}
SPLITS = {"auto": (None, True), "one": (1, True), "four-fused": (4, True), "four-merge-state": (4, False)}
LAYERS = 3
PER_LAYER = ("q", "k_cache", "v_cache", "k_scale", "v_scale")


@pytest.fixture(scope="module")
def api():
    return cuda_api_with([])


def layers_of(op, rng, step: str, layers: int = LAYERS) -> list[dict]:
    """Inputs of `layers` layers of one step: the step's tokens and page table shared, q and the caches fresh."""
    kv_lens, q_lens = STEPS[step]
    first = testing.attention_inputs(op, rng, kv_lens, q_lens)
    out = [first]
    for _ in range(layers - 1):
        fresh = testing.attention_inputs(op, rng, kv_lens, q_lens)
        out.append({**first, **{k: fresh[k] for k in PER_LAYER if k in fresh}})
    return out


def plan_of(op, inputs, **kw):
    return attention.plan(op, inputs["num_tokens"], inputs["num_seqs"], inputs["max_pages"] * op.page_size, **kw)


def poisoned(dev, op):
    out = torch.full_like(dev["q"], float("nan"))
    lse = torch.full(dev["q"].shape[:2], float("nan"), device=dev["q"].device)
    return out, lse


def assert_workspace_zero(name, p):
    for k in ("split_counters", "item_queue"):
        if k in p.workspace:
            assert not p.workspace[k].any(), f"{name}: the plan's {k} must be zero after a run"


@gpu
@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("kv", list(OPS))
def test_plan_once_run_every_layer(api, rng, kv, step, splits):
    op = OPS[kv]
    num_splits, fused_merge = SPLITS[splits]
    layers = layers_of(op, rng, step)
    p = plan_of(op, layers[0], num_splits=num_splits, fused_merge=fused_merge)
    index = torch.cuda.current_device()
    want = choose_config(op, layers[0]["num_tokens"], layers[0]["num_seqs"], layers[0]["max_pages"] * op.page_size,
                         device_sms(index), device_arch(index), num_splits, fused_merge)
    assert p.config == want and p.op == op and p.num_splits == want.num_splits
    assert p.config.decode_only == (step == "decode")
    assert (p.merge is not None) == (p.num_splits > 1 and not fused_merge)
    for i, inputs in enumerate(layers):
        dev = device_inputs(op, inputs)
        out, lse = poisoned(dev, op)
        got = attention.run(p, **dev, out=out, lse=lse)
        torch.cuda.synchronize()
        assert got[0] is out and got[1] is lse
        check_outputs(f"{kv}/{step}/{splits}/layer{i}", op, inputs, out, lse)
        assert_workspace_zero(f"layer{i}", p)


@gpu
def test_run_allocates_outputs_when_none_are_given(api, rng):
    op = OPS["bf16"].replace(return_lse=False)
    inputs = layers_of(op, rng, "decode", 1)[0]
    p = plan_of(op, inputs, num_splits=4)
    out = attention.run(p, **device_inputs(op, inputs))
    torch.cuda.synchronize()
    assert isinstance(out, torch.Tensor) and out.shape == (inputs["num_tokens"], op.num_q_heads, op.head_dim)
    check_outputs("allocated", op, inputs, out)


@gpu
def test_run_refuses_another_steps_page_table(api, rng):
    op = OPS["bf16"]
    inputs = layers_of(op, rng, "decode", 1)[0]
    p = plan_of(op, inputs)
    dev = device_inputs(op, inputs)
    with pytest.raises(ValueError, match="page_table"):
        attention.run(p, **{**dev, "page_table": dev["page_table"][:-1]})


@gpu
def test_plans_share_one_workspace_across_layers(api, rng):
    """A mixed step and a decode step planned on one Workspace (the larger first: the smaller's buffers are views
    of the same memory), run in turn on one stream over three layers each: both match the reference and leave the
    shared counters and item queue zero."""
    op = OPS["bf16"]
    ws = attention.Workspace("cuda")
    mixed, decode = layers_of(op, rng, "mixed"), layers_of(op, rng, "decode")
    p_mixed = plan_of(op, mixed[0], num_splits=8, workspace=ws)
    p_decode = plan_of(op, decode[0], num_splits=4, workspace=ws)
    assert p_decode.config.decode_only and not p_mixed.config.decode_only
    assert p_mixed.config.item_queue or device_arch(torch.cuda.current_device()) != "sm_90"  # Hopper: the queue too
    for k in ("o_partial", "split_counters"):
        assert p_decode.workspace[k].untyped_storage().data_ptr() == p_mixed.workspace[k].untyped_storage().data_ptr()
    for i in range(LAYERS):
        for name, p, inputs in (("mixed", p_mixed, mixed[i]), ("decode", p_decode, decode[i])):
            dev = device_inputs(op, inputs)
            out, lse = poisoned(dev, op)
            attention.run(p, **dev, out=out, lse=lse)
            torch.cuda.synchronize()
            check_outputs(f"{name}/layer{i}", op, inputs, out, lse)
            assert_workspace_zero(f"{name}/layer{i}", p)


def shorter_by_sequence(rng, inputs) -> np.ndarray:
    """token_kv_len less a draw of 0..40 a sequence, keeping each sequence's tokens consecutive positions >= 1."""
    kv, seq = inputs["token_kv_len"], inputs["token_seq"]
    less = np.zeros(inputs["num_seqs"], dtype=np.int64)
    for s in range(inputs["num_seqs"]):
        lens = kv[seq == s]
        less[s] = rng.integers(0, min(40, int(lens.min()) - 1) + 1)
    return (kv - less[seq]).astype(kv.dtype)


@gpu
@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_graph_of_run_follows_inputs_changed_in_place(api, rng, step):
    """run() over two layers captured once (a plan with split-KV and the fused merge), replayed after the inputs
    change in place: fresh q, K and V and a new page table, then shorter kv lengths as well; the outputs follow."""
    op = OPS["bf16"]
    layers = layers_of(op, rng, step, 2)
    p = plan_of(op, layers[0], num_splits=4)
    assert p.config.fused_merge
    devs = [device_inputs(op, inputs) for inputs in layers]
    outs = [poisoned(dev, op) for dev in devs]
    calls = [lambda d=d, o=o: attention.run(p, **d, out=o[0], lse=o[1]) for d, o in zip(devs, outs)]
    graph = api.capture_graph(calls)
    for replay in range(2):
        fresh = layers_of(op, rng, step, 2)  # the same shapes, another page table
        if replay == 1:  # each sequence's tokens see up to 40 positions fewer (their page table rows still cover them)
            fresh = [{**f, "token_kv_len": shorter_by_sequence(rng, f)} for f in fresh]
        for dev, inputs, (out, lse) in zip(devs, fresh, outs):
            for k, t in dev.items():
                t.copy_(to_dev(inputs[k]))
            out.fill_(float("nan")), lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (inputs, (out, lse)) in enumerate(zip(fresh, outs)):
            check_outputs(f"{step}/replay{replay}/layer{i}", op, inputs, out, lse)
        assert_workspace_zero(f"replay{replay}", p)


@gpu
def test_run_binds_the_step_once_and_checks_each_layer(api, rng):
    """run() checks the step's tensors once (the plan's bound call) and each layer's q, caches and out every call:
    three layers on one set of step tensors match the reference, and a later layer's wrong dtype, shape or device
    is refused with the plain call's error."""
    op = OPS["bf16"].replace(return_lse=False)
    layers = layers_of(op, rng, "mixed")
    p = plan_of(op, layers[0])
    step = {k: v for k, v in device_inputs(op, layers[0]).items() if k not in PER_LAYER}
    for i, inputs in enumerate(layers):
        dev = {**device_inputs(op, inputs), **step}
        out = torch.full_like(dev["q"], float("nan"))
        attention.run(p, **dev, out=out)
        torch.cuda.synchronize()
        check_outputs(f"layer {i}", op, inputs, out)
    assert len(p.launchers) == 1
    dev = {**device_inputs(op, layers[0]), **step}
    with pytest.raises(TypeError, match="q"):
        attention.run(p, **{**dev, "q": dev["q"].half()})
    with pytest.raises(ValueError, match="q"):
        attention.run(p, **{**dev, "q": dev["q"][:, :, :64].contiguous()})
    with pytest.raises(ValueError, match="k_cache"):
        attention.run(p, **{**dev, "k_cache": dev["k_cache"].cpu()})
