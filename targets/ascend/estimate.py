"""An estimate, per shape, of what the generated paged-attention kernel (the vector kernel)
costs on a 910B: HBM bytes and the HBM floor (generate.roofline_estimate), the matrix FLOPs
of QK^T and PV, the vector instructions the kernel issues, and a time from both.

How it is computed (an estimate from the kernel's structure and stated assumptions, never a
measurement; no Ascend hardware ran it):
  - per query row, query head and KV position the kernel issues Mul + ReduceSum (q.k) and
    Muls + Add (p.v): 4 dependent vector instructions, each followed by a PipeBarrier;
  - per query row, query head and KV tile of `TILE` positions, ~7 more (ReduceMax, Adds,
    Duplicate, 2 Exp, ReduceSum, the rescale Muls);
  - the work items (token, KV head) are shared by the part's vector cores; each dependent
    instruction costs CYCLES_PER_DEPENDENT_INSTR cycles at CLOCK_HZ (assumed, not measured);
  - loads do not overlap compute in this kernel, so time = HBM floor + vector time.
Decode: `seqs` sequences of one query row over `kv_len` positions. Prefill: one sequence of
`kv_len` query rows, causal, so row t reads t + 1 positions.
"""
from __future__ import annotations

from .generate import DEFAULT_SOC, SOCS, plan, roofline_estimate

CLOCK_HZ = 1.8e9  # AI core clock (assumed)
CYCLES_PER_DEPENDENT_INSTR = 32  # issue + one 256 B repeat + PipeBarrier drain (assumed)
PER_POSITION = 4  # Mul, ReduceSum, Muls, Add per (row, head, position)
PER_TILE = 7  # softmax bookkeeping per (row, head, tile)
# (name, mode, sequences, kv_len): the 32 x 4K decode and the seed's 8 x 16K decode and 16K prefill
SHAPES = (("decode 32 x 4K", "decode", 32, 4096), ("decode 8 x 16K", "decode", 8, 16384),
          ("prefill 16K", "prefill", 1, 16384))


def estimate(op, soc: str = DEFAULT_SOC) -> list[dict]:
    """One estimate per SHAPES entry for a paged_attention op (or kernel); labelled as estimates."""
    if op.kind != "paged_attention":
        raise ValueError(f"op: the instruction estimate covers paged_attention, not {op.kind}")
    tile = plan(op, soc).consts["TILE"]
    cores = SOCS[soc][0]
    out = []
    for name, mode, seqs, kv_len in SHAPES:
        if mode == "decode":
            rows, positions = seqs, seqs * kv_len  # positions summed over query rows
            tiles = seqs * -(-kv_len // tile)
        else:
            rows, positions = kv_len, kv_len * (kv_len + 1) // 2
            tiles = sum(-(-(t + 1) // tile) for t in range(kv_len))
        instr = op.num_q_heads * (PER_POSITION * positions + PER_TILE * tiles)
        roof = roofline_estimate(op, num_tokens=rows, kv_len=positions // rows)
        floor = roofline_estimate(op, num_tokens=rows, kv_len=seqs * kv_len // rows)["seconds"]  # KV read once
        vector_s = instr / cores * CYCLES_PER_DEPENDENT_INSTR / CLOCK_HZ
        seconds = roof["seconds"] + vector_s
        out.append({"shape": name, "mode": mode, "sequences": seqs, "kv_len": kv_len, "tile": tile,
                    "hbm_bytes": roof["bytes"], "hbm_floor_us": floor * 1e6,
                    "matmul_flops": 4 * op.num_q_heads * op.head_dim * positions,
                    "cube_flops": 0, "vector_instructions": instr, "estimate_us": seconds * 1e6,
                    "vs_floor": seconds / floor, "label": "estimate (not measured)",
                    "basis": f"{roof['basis']}; {CYCLES_PER_DEPENDENT_INSTR} cycles a dependent vector instruction "
                             f"at {CLOCK_HZ / 1e9:g} GHz over {cores} vector cores; loads not overlapped"})
    return out


def summary(e: dict) -> str:
    """One line of an estimate."""
    return (f"{e['shape']}: ~{e['estimate_us']:,.0f} us vs HBM floor {e['hbm_floor_us']:,.0f} us "
            f"({e['vs_floor']:.1f}x), {e['vector_instructions'] / 1e6:,.1f} M vector instr, "
            f"{e['matmul_flops'] / 1e9:,.1f} GFLOP matmul on the vector unit, {e['hbm_bytes'] / 1e6:,.0f} MB [estimate]")
