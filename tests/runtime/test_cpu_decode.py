"""cpu_decode.py on stories260K (tvm-cpu): a lone sequence's decode steps replayed from one recorded forward give
the logits of the ordinary path bit for bit (float32 weights, and Q8_0 ones that run packed; a small model on two
threads replays on one and gets the pool back); the replay does recompute (poisoned logits are overwritten); batches
of two, traced engines and models the tape cannot hold run the ordinary path."""
import pytest
import torch

from uacompile.models import STORIES260K
from uacompile.runtime import LLM, SamplingParams
from uacompile.runtime import cpu_decode, kernels
from uacompile.runtime.trace import Tracer

PROMPT = "Once upon a time"


def make_llm(threads: int = 1, **kw):
    return LLM(model=str(STORIES260K), device="cpu", cpu_threads=threads, progress=False, log_stats_interval=0, **kw)


def decode(llm, n: int = 40, replay: bool = True, prompts=(PROMPT,)):
    """Each step's logits (cloned) and every request's tokens, with the decode program on or off."""
    eng = llm.engine
    eng.executor.decode_program.enabled = replay and eng.model.dtype == torch.float32
    seen, launch = [], eng.sampler.launch

    def record(seqs, logits, masks=None):
        seen.append(logits.clone())
        return launch(seqs, logits, masks)

    eng.sampler.launch = record
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    eng.sampler.launch = launch
    tokens = [eng.output(r).outputs[0].token_ids for r in rids]
    for r in rids:
        eng.release(r)
    return seen, tokens


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def assert_same(a, b):
    assert len(a[0]) == len(b[0]) and a[1] == b[1]
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)


def test_replayed_decode_steps_give_the_ordinary_logits_bit_for_bit(llm):
    plain = decode(llm, replay=False)
    replayed = decode(llm)
    prog = llm.engine.executor.decode_program
    assert prog.enabled and len(prog.tapes) == 1  # recorded once, replayed by every later decode step
    assert_same(replayed, plain)
    assert len(plain[1][0]) == 40


def test_a_small_model_on_two_threads_replays_on_one_and_restores_the_pool(monkeypatch):
    llm = make_llm(threads=2)
    backend, prog = llm.engine.kernels, llm.engine.executor.decode_program
    assert prog.small and backend.threads == 2
    sizes, real = [], backend.threads_setter()
    monkeypatch.setattr(backend, "threads_setter", lambda: lambda n: sizes.append(n) or real(n))
    plain = decode(llm, n=12, replay=False)
    assert not sizes
    assert_same(decode(llm, n=12), plain)
    assert sizes == [1, 2] * 10  # every replay (the steps after the prompt's and the recorded one), restored after


def test_a_model_over_the_one_thread_size_replays_on_every_thread(monkeypatch):
    monkeypatch.setattr(cpu_decode, "ONE_THREAD_BYTES", 0)
    llm = make_llm(threads=2)
    prog = llm.engine.executor.decode_program
    decode(llm, n=6)
    assert not prog.small and prog.tapes and prog.pool is None


def test_a_replay_recomputes_the_logits(llm):
    decode(llm, n=4)
    (tape,) = llm.engine.executor.decode_program.tapes.values()
    with torch.inference_mode():
        tape.logits.fill_(float("nan"))
    seen, _ = decode(llm, n=4)
    assert all(bool(torch.isfinite(x).all()) for x in seen)


def test_q8_0_weights_replay_their_packed_kernels_bit_for_bit():
    llm = make_llm(quantization="q8_0")
    assert "q8_0" in llm.engine.model.weight_formats()
    plain = decode(llm, n=24, replay=False)
    replayed = decode(llm, n=24)
    assert llm.engine.executor.decode_program.tapes
    assert_same(replayed, plain)


def test_two_sequences_run_the_ordinary_path(llm):
    prog = llm.engine.executor.decode_program
    prog.tapes.clear()
    two = ("Once upon a time", "Lily liked to")
    both = decode(llm, n=8, prompts=two)
    assert not prog.tapes
    assert both[1] == decode(llm, n=8, prompts=two, replay=False)[1]


def test_a_traced_engine_runs_the_ordinary_path():
    llm = make_llm()
    llm.engine.set_tracer(Tracer())
    decode(llm, n=6)
    assert not llm.engine.executor.decode_program.tapes


def test_a_model_on_other_layer_ops_runs_the_ordinary_path():
    llm = make_llm()
    llm.engine.model.layer_backend = kernels.TorchLayerOps()
    decode(llm, n=6)
    assert not llm.engine.executor.decode_program.tapes


def test_a_step_the_tape_cannot_hold_turns_recording_off(monkeypatch):
    llm = make_llm()
    monkeypatch.setitem(kernels.CPU_LAYER_KERNEL_ROWS, "rope", 0)  # rope in torch: not recordable
    prog = llm.engine.executor.decode_program
    tried = decode(llm, n=12)
    assert not prog.enabled and not prog.tapes
    assert_same(tried, decode(llm, n=12, replay=False))
