"""Tell a story with stories260K on the CPU (TVM-LLVM kernels):

    python examples/story.py
    python examples/story.py --prompt "Tom found a box" --max-tokens 200 --temperature 0.8 --seed 1

The model is found in $UACOMPILE_MODELS_DIR, else ../shared/models beside the repository
(or pass --model PATH: any supported GGUF or Hugging Face directory).
"""
import argparse
import sys
import time

from uacompile.runtime import LLM, SamplingParams
from uacompile.runtime.loader import models_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(models_dir() / "stories260K.gguf"))
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args(argv)

    try:
        llm = LLM(args.model, device=args.device, cpu_threads=1 if args.device == "cpu" else None)
    except FileNotFoundError as e:
        print(f"{e}\nset UACOMPILE_MODELS_DIR or pass --model", file=sys.stderr)
        return 1
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    out = llm.generate(args.prompt, params)[0].outputs[0]
    took = time.perf_counter() - start
    print(args.prompt + out.text)
    print(f"\n[{len(out.token_ids)} tokens in {took:.2f} s, {len(out.token_ids) / took:.0f} tok/s, "
          f"finish: {out.finish_reason}, kernels: {llm.engine.kernels.name}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
