"""Tell a story with stories260K on the CPU (TVM-LLVM kernels):

    python examples/story.py
    python examples/story.py --prompt "Tom found a box" --max-tokens 200 --temperature 0.8 --seed 1

The model ships inside the package (uacompile.models.STORIES260K); --model PATH takes any
supported GGUF file or Hugging Face directory instead.
"""
import argparse
import sys
import time

from uacompile.runtime import LLM, SamplingParams
from uacompile.models import STORIES260K


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(STORIES260K), help="GGUF file or Hugging Face directory")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args(argv)

    try:  # a bad value answers with one line and exit 2, not a traceback
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                seed=args.seed)
        llm = LLM(args.model, device=args.device, cpu_threads=1 if args.device == "cpu" else None)
        start = time.perf_counter()
        out = llm.generate(args.prompt, params)[0].outputs[0]
        took = time.perf_counter() - start
    except (ValueError, TypeError, OSError) as e:
        print(f"story.py: error: {e}", file=sys.stderr)
        return 2
    print(args.prompt + out.text)
    print(f"\n[{len(out.token_ids)} tokens in {took:.2f} s, {len(out.token_ids) / took:.0f} tok/s, "
          f"finish: {out.finish_reason}, kernels: {llm.engine.kernels.name}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
