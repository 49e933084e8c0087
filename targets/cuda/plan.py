"""Plan once, run many: how one step's paged attention runs on a CUDA device.

    p = plan(op, num_tokens=T, num_seqs=S, max_kv_len=L, device="cuda")   # once per step
    attention.run(p, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out=out)   # every layer

A Plan holds the kernel (op + AttentionConfig) the step launches, its split-KV partials and counters (a
Workspace: allocated and zeroed here, reused by every layer and every replay of a captured CUDA graph), and
the merge kernel where the split partials are merged by a second launch. The config comes from the shapes
alone (so a captured graph fixes it), or is given. Nothing here runs per layer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from uacompile import ir
from .config import AttentionConfig
from .layout import H200_SMS, check, check_fits, layout, uses_wgmma

MIN_SPLIT_LEN = 256  # a split shorter than this spends more on its merge than it gains
MAX_SPLITS = 64
FULL_WAVE = 0.9  # prefill: items covering this share of the resident block slots keep every SM busy
WAVE_FILL_SLACK = 0.05  # decode: the fewest splits whose waves are within this of the best fill
MANY_WAVES = 4  # decode: items filling this many waves already leave little idle at the end


def choose_splits(op: ir.PagedAttention, config: AttentionConfig, num_tokens: int, num_seqs: int, max_kv_len: int,
                  num_sms: int = H200_SMS, arch: str = "sm_90") -> int:
    """Occupancy-aware split count for a kernel of `config`'s layout, from shapes only (graph-safe).

    Work items = blocks of one split: decode tokens (at most one per sequence) or prefill
    tiles, times KV heads; slots = items the GPU runs at once (resident blocks, times their
    decode groups on the Hopper path). Items of one split count take the same time, so they
    run in waves, and the last wave's empty slots are idle bandwidth: the wave fill of s splits
    is units / (waves * slots). The rule takes the fewest splits whose fill is within
    WAVE_FILL_SLACK of the best any count reaches (more splits: more block starts and merge
    traffic; docs/attention-rationale.md has the measurements behind it).
    - No split for prefill items covering FULL_WAVE of the slots (causal tiles differ in
      length, so waves blur), nor for decode items filling MANY_WAVES waves.
    Never a split shorter than MIN_SPLIT_LEN positions or more than MAX_SPLITS; on the Hopper path,
    whose blocks run two decode groups on consecutive splits, an even count.
    """
    if op.variant == "unified_masked" or num_tokens <= 0:
        return 1
    if op.window:
        max_kv_len = min(max_kv_len, op.window)
    decode_like = num_tokens <= 2 * num_seqs
    lay = layout(op, config, arch)
    tile_tokens = lay.prefill_rows // op.group_size
    items = (min(num_tokens, num_seqs) if decode_like else -(-num_tokens // tile_tokens)) * op.num_kv_heads
    slots = num_sms * lay.blocks_per_sm * (lay.decode_groups if decode_like else 1)
    if items >= (MANY_WAVES if decode_like else FULL_WAVE) * slots:
        return 1
    limit = min(MAX_SPLITS, max(1, max_kv_len // MIN_SPLIT_LEN))
    groups = lay.decode_groups if decode_like else 1  # a block's decode groups take consecutive splits
    counts = [s for s in range(1, limit + 1) if s == 1 or s % groups == 0]

    def fill(s: int) -> float:  # share of the waves' slots the (item, split) units take
        units = items * (s if s == 1 else -(-s // groups) * groups)
        return units / (-(-units // slots) * slots)

    best = max(fill(s) for s in counts)
    return next(s for s in counts if fill(s) >= best - WAVE_FILL_SLACK)


def tuned_config(op: ir.PagedAttention, tuned, num_tokens: int, num_seqs: int, max_kv_len: int,
                 arch: str) -> AttentionConfig | None:
    """The tuning database's config for the step's bucket (tunedb.Tuned: looked up once per (op, bucket)), or None
    where there is no record or its config does not run here (logged once)."""
    config = tuned.config(op, num_tokens, num_seqs, max_kv_len)
    if config is None:
        return None
    if not isinstance(config, AttentionConfig):
        return None
    if config.decode_only and num_tokens > num_seqs:
        return None
    try:
        check(op, config)
        check_fits(op, config, arch)
    except ir.IRError as e:
        _refused(op.key(), repr(config), arch, str(e))
        return None
    return config.replace(item_queue=config.item_queue and uses_wgmma(op, config, arch))


@functools.lru_cache(maxsize=None)
def _refused(op_key: str, config: str, arch: str, why: str) -> None:  # logged once per record
    import logging

    logging.getLogger(__name__).warning("tuned %s for op %s does not run on %s (%s): the built-in rule runs",
                                        config, op_key, arch, why)


def choose_config(op: ir.PagedAttention, num_tokens: int, num_seqs: int, max_kv_len: int, num_sms: int = H200_SMS,
                  arch: str = "sm_90", num_splits: int | None = None, fused_merge: bool = True,
                  tuned=None) -> AttentionConfig:
    """The tuned config of the step's bucket where `tuned` (a tunedb.Tuned of this device) has a record that runs
    here and num_splits is not given; else the built-in rule: the decode-only kernel for a decode step (at most
    one token a sequence), split-KV by choose_splits (or num_splits), merged in the same launch unless
    fused_merge=False, and the dynamic item queue wherever the kernel runs the Hopper prefill path."""
    if tuned and num_splits is None:
        config = tuned_config(op, tuned, num_tokens, num_seqs, max_kv_len, arch)
        if config is not None:
            return config
    decode_only = num_tokens <= num_seqs
    base = AttentionConfig(decode_only=decode_only)
    if num_splits is None:
        num_splits = choose_splits(op, base, num_tokens, num_seqs, max_kv_len, num_sms, arch)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    config = base.replace(num_splits=num_splits, fused_merge=fused_merge and num_splits > 1)
    return config.replace(item_queue=uses_wgmma(op, config, arch))


def reachable_configs(op: ir.PagedAttention, max_tokens: int, max_seqs: int, max_kv_len: int,
                      num_sms: int = H200_SMS, arch: str = "sm_90", tuned=None) -> set[AttentionConfig]:
    """Every config choose_config returns for a step within these limits (at most max_tokens tokens of at most
    max_seqs sequences, none longer than max_kv_len): the kernels a server must have built before it serves.
    choose_splits reads the tokens only through the items they make and the length only in MIN_SPLIT_LEN
    steps, so the walk is over those; with `tuned`, the configs of its records for op that run here join them."""
    lay = layout(op, AttentionConfig(), arch)
    tile = max(1, lay.prefill_rows // op.group_size)
    lengths = sorted({min(max_kv_len, k * MIN_SPLIT_LEN) for k in range(max_kv_len // MIN_SPLIT_LEN + 1)} | {max_kv_len})
    steps = set()
    for T in range(1, max_seqs + 1):  # decode steps: T tokens of >= T sequences
        steps.add((T, T))
    for S in range(1, max_seqs + 1):  # up to 2 tokens a sequence: items = sequences
        steps.update((T, S) for T in (S + 1, 2 * S) if T <= max_tokens)
    for n in range(1, -(-max_tokens // tile) + 1):  # prefill: items = tiles
        T = min(max_tokens, n * tile)
        steps.add((T, max(1, min(max_seqs, -(-T // 2) - 1))) if T > 2 else (T, 1))
    configs = {choose_config(op, T, S, L, num_sms, arch) for T, S in steps for L in lengths}
    for c in (tuned.configs(op) if tuned else ()):
        if isinstance(c, AttentionConfig):
            try:
                check(op, c)
                check_fits(op, c, arch)
            except ir.IRError:
                continue
            configs.add(c.replace(item_queue=c.item_queue and uses_wgmma(op, c, arch)))
    return configs


@functools.lru_cache(maxsize=None)
def device_arch(device) -> str:
    """sm_XY of a CUDA device (index, name or torch.device)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def device_sms(device) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


class Workspace:
    """Device buffers that plans carve their split partials, counters and item queue from: grown on demand, never
    shrunk, kept by whoever plans (one per stream: launches sharing it must not run concurrently). Counters and
    the item queue are zeroed once when allocated; every launch leaves them zero again."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self._f32 = self._i32 = self._queue = None

    def _grow(self, buf, n: int, zero: bool, dtype):
        import torch

        if buf is None or buf.numel() < n:
            buf = (torch.zeros if zero else torch.empty)(max(n, 1), dtype=dtype, device=self.device)
        return buf

    def partials(self, splits: int, tokens: int, heads: int, head_dim: int):
        """(o_partial [splits, tokens, heads, head_dim], lse_partial [splits, tokens, heads]) float32 views."""
        import torch

        n_o, n_l = splits * tokens * heads * head_dim, splits * tokens * heads
        self._f32 = self._grow(self._f32, n_o + n_l, False, torch.float32)
        return (self._f32[:n_o].view(splits, tokens, heads, head_dim),
                self._f32[n_o:n_o + n_l].view(splits, tokens, heads))

    def counters(self, tokens: int, kv_heads: int):
        import torch

        self._i32 = self._grow(self._i32, tokens * kv_heads, True, torch.int32)
        return self._i32[:tokens * kv_heads].view(tokens, kv_heads)

    def item_queue(self):
        import torch

        self._queue = self._grow(self._queue, 2, True, torch.int32)
        return self._queue


@dataclass(frozen=True)
class Plan:
    """One step's attention launch on one device: built by plan(), passed to attention.run() every layer."""

    op: ir.PagedAttention
    config: AttentionConfig
    kernel: object  # api.CudaKernel of (op, config)
    merge: object  # api.CudaKernel of merge_state when the partials are merged by a second launch, else None
    num_tokens: int
    num_seqs: int
    device_index: int
    workspace: dict  # tensor name -> the plan's buffer (o_partial, lse_partial, split_counters, item_queue)
    launchers: dict = field(default_factory=dict)  # attention.run's bound call (api.Launcher) of the step's tensors

    @property
    def num_splits(self) -> int:
        return self.config.num_splits


def plan(op: ir.PagedAttention, num_tokens: int, num_seqs: int, max_kv_len: int, device=None, *,
         config: AttentionConfig | None = None, num_splits: int | None = None, fused_merge: bool = True,
         workspace: Workspace | None = None, kernel_of=None, tuned=None) -> Plan:
    """The launch of one step: config (given, or choose_config from the shapes; num_splits / fused_merge narrow
    the built-in rule), the kernels built or taken from the process's kernel table, and the workspaces (from
    `workspace`, else a fresh one the plan owns). Graph-safe: nothing is allocated at run time.
    kernel_of(kernel) -> CudaKernel overrides the process's kernel table (api.kernel).
    tuned: a tunedb.Tuned whose record for the step's bucket choose_config takes; None: the default tuning
    database's view for this device (read once per process); False: the built-in rule only."""
    import torch

    from . import api

    if not isinstance(op, ir.PagedAttention):
        raise TypeError(f"op must be an ir.PagedAttention, got {type(op).__name__}")
    for name, v in (("num_tokens", num_tokens), ("num_seqs", num_seqs), ("max_kv_len", max_kv_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"plan: {name} must be an int >= 0, got {v!r}")
    check(op)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"plan: device must be a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = device_arch(index)
    if config is None:
        if tuned is None:
            from uacompile.tunedb import default_tuned

            tuned = default_tuned("cuda", index)
        config = choose_config(op, num_tokens, num_seqs, max_kv_len, device_sms(index), arch, num_splits, fused_merge,
                               tuned or None)
    elif not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
    check(op, config)
    config = config.replace(item_queue=config.item_queue and uses_wgmma(op, config, arch))
    check_fits(op, config, arch)
    kernel_of = kernel_of or api.kernel
    ws = workspace if workspace is not None else Workspace(device)
    buffers = {}
    S = config.num_splits
    if S > 1:
        buffers["o_partial"], buffers["lse_partial"] = ws.partials(S, num_tokens, op.num_q_heads, op.head_dim)
    if config.fused_merge:
        buffers["split_counters"] = ws.counters(num_tokens, op.num_kv_heads)
    if config.item_queue:
        buffers["item_queue"] = ws.item_queue()
    kernel, merge = launched_kernels(op, config)
    merge = kernel_of(merge) if merge is not None else None
    return Plan(op, config, kernel_of(kernel), merge, num_tokens, num_seqs, index, buffers)


def launched_kernels(op: ir.PagedAttention, config: AttentionConfig) -> tuple[ir.Kernel, ir.Kernel | None]:
    """(the attention kernel, the merge_state kernel or None) that a plan of config launches: split partials not
    merged in the launch are merged by merge_state, and then the split kernel writes no lse of its own."""
    S = config.num_splits
    if S == 1 or config.fused_merge:
        return ir.Kernel(op, config), None
    merge = ir.Kernel(ir.MergeState(num_heads=op.num_q_heads, head_dim=op.head_dim, num_splits=S,
                                    out_dtype=op.q_dtype, return_lse=op.return_lse))
    return ir.Kernel(op.replace(return_lse=False), config), merge


__all__ = ["MIN_SPLIT_LEN", "MAX_SPLITS", "choose_splits", "choose_config", "tuned_config", "reachable_configs", "device_arch", "device_sms", "Workspace",
           "Plan", "plan", "launched_kernels"]
