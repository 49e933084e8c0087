"""CUDA paged attention: plan once per step, run every layer.

    from uacompile.targets.cuda import attention
    p = attention.plan(op, num_tokens=T, num_seqs=S, max_kv_len=L)     # once per step (plan.py)
    attention.run(p, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out=out)   # each layer
    out = attention.paged_attention(op, q, k_cache, ...)              # plan + run in one call

One template (templates/cuda/paged_attention.cu.j2) serves decode tokens, prefill chunks and mixed ubatches in
one launch; the plan's AttentionConfig says how (split-KV, fused merge, the decode-only kernel, the Hopper item
queue). run() launches on torch's current stream, allocates nothing and is CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from uacompile import ir

from .config import AttentionConfig
from .plan import Plan, Workspace, plan

__all__ = ["AttentionConfig", "Plan", "Workspace", "plan", "run", "paged_attention"]


def run(p: Plan, q, k_cache, v_cache, token_seq, page_table, token_kv_len, *, out=None, lse=None, k_scale=None,
        v_scale=None, alibi_slopes=None):
    """Attention of the planned step over one layer's paged cache; returns out (and lse with op.return_lse).
    out (and lse) are allocated when not given (not graph-safe then). Tokens may come in any order (a
    sequence's tokens side by side share K/V loads as a prefill tile; a lone token is a decode item)."""
    op = p.op
    if page_table.shape[0] != p.num_seqs:
        raise ValueError(f"paged_attention.page_table: planned for {p.num_seqs} sequences, got {page_table.shape[0]} rows")
    if out is None:
        out = torch.empty_like(q)
    if op.return_lse and lse is None:
        lse = torch.empty((q.shape[0], op.num_q_heads), dtype=torch.float32, device=q.device)
    layer = dict(q=q, k_cache=k_cache, v_cache=v_cache)
    if op.quantized:
        layer.update(k_scale=k_scale, v_scale=v_scale)
    final = dict(out=out, lse=lse) if op.return_lse else dict(out=out)
    if p.merge is None:
        layer.update(final)
    # the step's tensors (the same every layer) and the workspaces are checked once, when the launcher is made
    launch = p.launchers.get("run")
    if (launch is None or launch.fixed["token_seq"] is not token_seq or launch.fixed["page_table"] is not page_table
            or launch.fixed["token_kv_len"] is not token_kv_len
            or (op.alibi and launch.fixed["alibi_slopes"] is not alibi_slopes)):
        fixed = dict(token_seq=token_seq, page_table=page_table, token_kv_len=token_kv_len, **p.workspace)
        if op.alibi:
            fixed["alibi_slopes"] = alibi_slopes
        launch = p.launchers["run"] = p.kernel.launcher(fixed, layer)
    launch(*layer.values())
    if p.merge is not None:  # split partials, then merge_state
        p.merge(o_partial=p.workspace["o_partial"], lse_partial=p.workspace["lse_partial"], **final)
    return (out, lse) if op.return_lse else out


def paged_attention(op: ir.PagedAttention, q, k_cache, v_cache, token_seq, page_table, token_kv_len, *,
                    k_scale=None, v_scale=None, alibi_slopes=None, out=None, lse=None, num_splits: int | None = None,
                    fused_merge: bool = True, config: AttentionConfig | None = None, workspace: Workspace | None = None,
                    kernel_of=None):
    """plan() for these tensors' shapes, then run(): one call. num_splits=None picks split-KV from the shapes;
    config fixes the whole run config; workspace keeps the split buffers between calls (else each call plans
    a fresh one). A serving loop should plan once per step and run() each layer instead."""
    if not isinstance(op, ir.PagedAttention):
        raise TypeError(f"op must be an ir.PagedAttention, got {type(op).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, {op.num_q_heads}, {op.head_dim}], got shape {tuple(q.shape)}")
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be [num_seqs, max_pages], got shape {tuple(page_table.shape)}")
    p = plan(op, q.shape[0], page_table.shape[0], page_table.shape[1] * op.page_size, q.device, config=config,
             num_splits=num_splits, fused_merge=fused_merge, workspace=workspace, kernel_of=kernel_of)
    return run(p, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out=out, lse=lse, k_scale=k_scale,
               v_scale=v_scale, alibi_slopes=alibi_slopes)
