"""Tiled FlashAttention-2 forward and backward in PyTorch, rounded where a `Precision` says.

This is the ground truth the kernels are tested against, and the lab bench of
the isolation experiments. It follows Algorithms 1 and 2 of FlashAttention-2:
an online softmax over key tiles in the forward (saving O and the log-sum-exp),
and recomputation of P from the log-sum-exp in the backward, with δ precomputed.

How rounding is emulated: every operation computes in the policy's compute
format (fp32, or fp64) and rounds its result once, as torch's kernels do.
Matmuls, reductions and exp/log round to their *site*'s format; elementwise
binary ops round to the promoted dtype of their operands, exactly as torch's
type promotion would; values written into a buffer round to the buffer's site
format. Autocast is switched off inside: it would run the matmuls in bf16 whatever
the policy says, and a forward whose log-sum-exp came from bf16 scores would not
match the backward's recomputed ones (gradient errors far above the `fp32` policy's own).

Numerical edge cases:
- masked keys (causal, a window, padding) and -inf scores give P = 0; a row whose scores are all -inf
  (no visible key) gets O = 0 and lse = -inf, and zero gradients;
- NaN in q, k or v, or +inf scores, propagate to NaN in the rows they touch,
  as in plain softmax attention.
"""

from __future__ import annotations

import functools
import math

import torch

from stableflash.attention.mask import ScoreMods, Visibility
from stableflash.attention.precision import SITE_INDEX, Precision, rounds_backward_stochastically
from stableflash.attention.stabilize import SFA, ClampPbar
from stableflash.attention.stats import AttentionStats, biasable_in_tile, tail_limit
from stableflash.numerics.formats import get_format
from stableflash.numerics.rounding import counter_bits, counter_noise, draw_seed, round_to


def _promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    if a == b:
        return a
    try:
        return torch.promote_types(a, b)
    except RuntimeError:  # fp8 has no promotion rules; compute in fp32
        return torch.float32


class _Rounder:
    """Rounding helpers bound to one policy and one input dtype."""

    def __init__(self, policy: Precision, input_dtype: torch.dtype, seed: int | None = None):
        self.policy = policy
        self.input_dtype = input_dtype
        self.cd = policy.compute_dtype()
        self.seed = seed  # stochastic rounding's, where a site says where its elements are (`site(..., at=...)`)

    def dtype(self, site: str) -> torch.dtype:
        return self.policy.dtype(site, self.input_dtype)

    def cast(self, x: torch.Tensor, dtype: torch.dtype, mode: str | None = None) -> torch.Tensor:
        """Round `x` (any dtype) to `dtype` under `mode` (default: the policy's mode where it covers every site,
        else nearest); returns a `dtype` tensor."""
        if mode is None:
            mode = "nearest" if self.policy.rounding_sites else self.policy.rounding
        if mode == "nearest" or x.dtype == dtype:
            return x.to(dtype)
        wider = torch.float64 if dtype == torch.float64 else torch.float32
        return round_to(x, get_format(dtype), mode, dtype=wider).to(dtype)

    def format(self, site: str):
        return self.policy.format(site, self.input_dtype)

    def site(self, name: str, x: torch.Tensor, at: tuple[int, int, int] | None = None) -> torch.Tensor:
        """`x` rounded to `name`'s format and mode. `at` = (first row, first column, tile) places a (B, H, rows,
        cols) tile in the whole: stochastic rounding there draws its bits from `counter_bits` of each element's
        position, as the fused kernels do; elsewhere from torch's generator."""
        sites = self.policy.rounding_sites
        mode = self.policy.rounding if not sites or name in sites else "nearest"
        fmt = self.format(name)
        if mode == "stochastic" and at is not None and self.seed is not None:
            noise = counter_noise(_tile_bits(self.seed, SITE_INDEX[name], x, at), fmt)
            rounded = round_to(x, fmt, mode, noise=noise, dtype=torch.float32)
            return rounded if fmt.torch_dtype is None else rounded.to(fmt.torch_dtype)
        if fmt.torch_dtype is None:  # e8m4 and the like: the format's values, held in fp32
            return round_to(x, fmt, mode, dtype=torch.float32)
        return self.cast(x, fmt.torch_dtype, mode)

    def up(self, x: torch.Tensor) -> torch.Tensor:
        """Value of `x` in the compute dtype."""
        return x.to(self.cd)

    def ew(self, fn, *args) -> torch.Tensor:
        """Elementwise op: compute in the compute dtype, round to the operands' promoted dtype."""
        dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
        result_dtype = dtypes[0]
        for d in dtypes[1:]:
            result_dtype = _promote(result_dtype, d)
        values = [self.up(a) if isinstance(a, torch.Tensor) else a for a in args]
        return self.cast(fn(*values), result_dtype)

    def mm(self, a: torch.Tensor, b: torch.Tensor, site: str, at: tuple[int, int, int] | None = None) -> torch.Tensor:
        return self.site(site, self.up(a) @ self.up(b), at)


def _tile_bits(seed: int, site: int, x: torch.Tensor, at: tuple[int, int, int]) -> torch.Tensor:
    """`counter_bits` for each element of a (B, H, rows, cols) tile whose first row and column are `at[:2]`."""
    B, H, rows, cols = x.shape
    device = x.device
    bh = (torch.arange(B, device=device)[:, None] * H + torch.arange(H, device=device)[None, :])[:, :, None, None]
    row = (at[0] + torch.arange(rows, device=device))[None, None, :, None]
    col = (at[1] + torch.arange(cols, device=device))[None, None, None, :]
    return counter_bits(seed, site, bh, row, col, at[2])


def stochastic_seed(policy: Precision) -> int | None:
    """The seed of one attention call's stochastic rounding (`draw_seed`); None where no site rounds stochastically."""
    return draw_seed() if policy.rounding == "stochastic" else None


def _visibility(causal: bool | Visibility, q, k) -> Visibility:
    """A `Visibility` from the public `causal` flag (or one passed through)."""
    if isinstance(causal, Visibility):
        return causal
    return Visibility(q.shape[-2], k.shape[-2], causal=causal)


def _tiles(length: int, block: int | None):
    block = length if block is None else block
    return [(start, min(block, length - start)) for start in range(0, length, block)]


def _scores(r: _Rounder, qi, kj, scale, vis: Visibility, i0, j0, mods: ScoreMods | None = None):
    return _scores_and_capped(r, qi, kj, scale, vis, i0, j0, mods)[0]


def _scores_and_capped(r: _Rounder, qi, kj, scale, vis: Visibility, i0, j0, mods: ScoreMods | None = None):
    """The tile's scores, and with a softcap the capped scores before any bias and mask (None without one): the
    backward's derivative through the cap is taken at them, not at the biased scores."""
    qk = r.mm(qi, kj.transpose(-1, -2), "qk")
    s = r.site("scores", r.ew(lambda a: a * scale, qk))
    capped = None
    if mods is not None and mods.softcap > 0:
        s = capped = r.site("scores", mods.softcap * torch.tanh(r.up(s) / mods.softcap))
    if mods is not None and mods.bias is not None:
        bias = mods.bias[..., i0:i0 + s.shape[-2], j0:j0 + s.shape[-1]]
        s = r.site("scores", r.up(s) + bias.to(device=s.device, dtype=r.cd))
    mask = vis.hidden(i0, qi.shape[-2], j0, kj.shape[-2], qi.device)
    if mask is not None:
        s = s.masked_fill(mask, -math.inf)
    return s, capped


def _policy_rounds_alone(fn):
    """Run `fn` with autocast off, so that the policy alone decides every rounding."""
    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        with torch.autocast(q.device.type, enabled=False):
            return fn(q, *args, **kwargs)
    return wrapper


def _near_max_count(r: _Rounder, s: torch.Tensor, rm: torch.Tensor, eps: float) -> torch.Tensor:
    gap = r.up(rm) - r.up(s)  # >= 0; exact enough for a threshold test
    return ((gap <= eps) & torch.isfinite(s)).sum(-1, keepdim=True)


def _official_near_max_count(r: _Rounder, s: torch.Tensor, rm: torch.Tensor, eps: float) -> torch.Tensor:
    """#{S >= rm - eps} as the official code counts: rm - eps rounds like an op on m, and a row with no visible
    key (rm = -inf here, the mask value there) counts every entry of the tile."""
    threshold = r.ew(lambda a: a - eps, rm)
    return (r.up(s) >= r.up(threshold)).sum(-1, keepdim=True)


@_policy_rounds_alone
def forward(q, k, v, *, scale: float, causal: bool | Visibility, policy: Precision, stabilize=None,
            stats: AttentionStats | None = None, heads=slice(None), row_flags: dict | None = None,
            mods: ScoreMods | None = None):
    """Tiled forward. Returns (out, o_saved, lse); see the module docstring for the rounding. With `row_flags` (a
    dict), it receives the statistics' per-row flags, (B, H, T) bool: "repeated", "positive" and "biasable"
    (`AttentionStats`; near-maxima within `stats.eps`, or 1e-3 without `stats`)."""
    r = _Rounder(policy, q.dtype, stochastic_seed(policy))
    vis = _visibility(causal, q, k)
    B, H, T, D = q.shape
    Tk = k.shape[-2]
    device = q.device
    pbar_fmt = r.format("pbar_operand")
    row_max_fmt = r.format("row_max")
    # per query tile, joined at the end (out of place: torch.func's vmap takes no writes into a buffer)
    outs, o_saves, lses = [], [], []
    saved_dtype = None if policy.o_saved == "out" else get_format(policy.o_saved).torch_dtype
    counting = stats is not None or row_flags is not None
    eps = stats.eps if stats is not None else AttentionStats.eps
    if counting:
        limit = tail_limit(r.format("pv").fraction_bits)
        repeated, positive, biasable = (torch.zeros(B, H, T, 1, dtype=torch.bool, device=device) for _ in range(3))
        ones = torch.zeros(H, dtype=torch.int64, device=device)
        max_score = torch.full((H,), -math.inf, device=device)

    official = isinstance(stabilize, SFA) and stabilize.official_rule
    for i0, bm in _tiles(T, policy.block_m):
        qi = q[:, :, i0:i0 + bm]
        m = torch.full((B, H, bm, 1), -math.inf, dtype=r.dtype("row_max"), device=device)
        l = torch.zeros(B, H, bm, 1, dtype=r.dtype("row_sum"), device=device)
        acc = torch.zeros(B, H, bm, D, dtype=r.dtype("acc"), device=device)
        for j0, bn in _tiles(Tk, policy.block_n):
            if vis.skips(i0, bm, j0, bn) and not official:  # the official SFA visits masked tiles too
                continue
            kj, vj = k[:, :, j0:j0 + bn], v[:, :, j0:j0 + bn]
            s = _scores(r, qi, kj, scale, vis, i0, j0, mods)
            # -- row statistics of this tile --
            tile_max = r.site("row_max", s.amax(-1, keepdim=True))
            if counting:
                repeats = _near_max_count(r, s, tile_max, eps) > 1
                repeated[:, :, i0:i0 + bm] |= repeats
                positive[:, :, i0:i0 + bm] |= repeats & (tile_max > 0)
                finite = torch.where(torch.isfinite(s), s, -math.inf)
                max_score = torch.maximum(max_score, finite.float().amax(dim=(0, 2, 3)))
            if isinstance(stabilize, SFA):
                count = _official_near_max_count if official else _near_max_count
                rs = count(r, s, tile_max, stabilize.eps)
                tile_max = r.site("row_max", stabilize.row_shift_max(r.up(tile_max), rs, row_max_fmt, pbar_fmt))
            m_new = r.site("row_max", r.ew(torch.maximum, tile_max, m))
            # a row with no visible key so far keeps m = -inf; shift it by 0 so exp gives 0, not NaN
            m_shift = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            # -- P̄ = exp(S - m) --
            pbar = r.site("pbar", torch.exp(r.up(r.ew(torch.sub, s, m_shift))))
            if isinstance(stabilize, ClampPbar):
                pbar = pbar.clamp(max=ClampPbar.ceiling(pbar_fmt))
            t = j0 // (policy.block_n or Tk)  # the key tile's ordinal: stochastic rounding's counter
            pbar_op = r.site("pbar_operand", pbar, (i0, j0, 0))
            if counting:
                tile_ones = (pbar_op == 1).sum(-1, keepdim=True)
                ones += tile_ones.sum(dim=(0, 2, 3))
                tail = r.up(pbar_op).float().sum(-1, keepdim=True) - tile_ones
                biasable[:, :, i0:i0 + bm] |= biasable_in_tile(tile_ones, tail, limit)
            tile_sum = r.site("tile_sum", r.up(pbar).sum(-1, keepdim=True), (i0, 0, t))
            if policy.tile_sum_clamp is not None:
                tile_sum = tile_sum.clamp(min=policy.tile_sum_clamp)
            pv = r.mm(pbar_op, r.site("v_operand", vj), "pv", (i0, 0, t))
            # -- rescale the running sum and accumulator --
            rescale = r.site("rescale", torch.exp(r.up(r.ew(torch.sub, m, m_shift))))
            l = r.site("row_sum", r.ew(torch.add, r.ew(torch.mul, rescale, l), tile_sum), (i0, 0, t))
            acc_scaled = r.site("acc_scaled", r.ew(torch.mul, acc, rescale), (i0, 0, t))
            acc = r.site("acc", r.ew(torch.add, acc_scaled, pv), (i0, 0, t))
            m = m_new
        # -- normalise; rows that saw no finite score (m = -inf) get O = 0 and lse = -inf.
        # (l = 0 with a finite m is P̄ underflow, e.g. the unbounded SFA rule: 0/0 = NaN, kept visible.)
        empty = torch.isneginf(m)
        l = r.site("row_sum_saved", l, (i0, 0, 0))  # the buffer that the division and the log-sum-exp read
        o_full = r.ew(torch.div, acc, torch.where(empty, torch.ones_like(l), l))
        o_full = o_full.masked_fill(empty, 0.0)
        outs.append(r.site("out", o_full, (i0, 0, 0)))
        if saved_dtype is not None:
            o_saves.append(r.cast(o_full, saved_dtype))
        log_l = r.site("lse", torch.log(r.up(l)))
        lses.append(r.site("lse", r.ew(torch.add, log_l, m)).masked_fill(empty, -math.inf))
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    o_saved = torch.cat(o_saves, dim=2) if saved_dtype is not None else None

    if row_flags is not None:
        row_flags.update(repeated=repeated[..., 0], positive=positive[..., 0], biasable=biasable[..., 0])
    if stats is not None:
        stats.add(heads, rows=B * T, repeated_max_rows=repeated.sum(dim=(0, 2, 3)), pbar_ones=ones, max_score=max_score,
                  repeated_max_rows_positive=positive.sum(dim=(0, 2, 3)), biasable_rows=biasable.sum(dim=(0, 2, 3)))
    return out, (out if o_saved is None else o_saved), lse


def _probabilities(r: _Rounder, s, lse_i):
    """P = exp(S - lse) with fully masked rows (lse = -inf) giving 0."""
    shifted = r.ew(torch.sub, s, torch.where(torch.isneginf(lse_i), torch.zeros_like(lse_i), lse_i))
    p = r.site("p", torch.exp(r.up(shifted)))
    return p.masked_fill(torch.isneginf(lse_i), 0.0)


def _delta(r: _Rounder, q, k, v, o_saved, lse, dout, scale, vis: Visibility, mods: ScoreMods | None = None):
    """δ per row by the policy's formula."""
    policy = r.policy
    T, Tk = q.shape[-2], k.shape[-2]
    if policy.delta_formula == "do_o":
        # the products round at their own site only: a fused kernel (FA2, inductor) keeps dO*O in fp32
        terms = r.site("delta_terms", r.up(dout) * r.up(o_saved), (0, 0, 0))
        return r.site("delta", r.up(terms).sum(-1, keepdim=True), (0, 0, 0))
    # the other two formulas need P row by row: one pass over the key tiles
    parts = []
    for i0, bm in _tiles(T, policy.block_m):
        qi, doi, lse_i = q[:, :, i0:i0 + bm], dout[:, :, i0:i0 + bm], lse[:, :, i0:i0 + bm]
        delta_i = torch.zeros(*qi.shape[:-1], 1, dtype=r.dtype("delta"), device=q.device)
        o_hp = torch.zeros(*qi.shape, dtype=torch.float64 if r.cd == torch.float64 else torch.float32, device=q.device)
        for j0, bn in _tiles(Tk, policy.block_n):
            if vis.skips(i0, bm, j0, bn):
                continue
            kj, vj = k[:, :, j0:j0 + bn], v[:, :, j0:j0 + bn]
            p = _probabilities(r, _scores(r, qi, kj, scale, vis, i0, j0, mods), lse_i)
            if policy.delta_formula == "dp_p":
                dp = r.mm(doi, vj.transpose(-1, -2), "dp")
                terms = r.site("delta_terms", r.ew(torch.mul, dp, p))
                part = r.site("delta", r.up(terms).sum(-1, keepdim=True))
                delta_i = r.site("delta", r.ew(torch.add, delta_i, part))
            else:  # do_o_recomputed: O = PV accumulated in fp32 (or fp64)
                o_hp = o_hp + p.to(o_hp.dtype) @ vj.to(o_hp.dtype)
        if policy.delta_formula == "do_o_recomputed":
            delta_i = r.site("delta", (doi.to(o_hp.dtype) * o_hp).sum(-1, keepdim=True))
        parts.append(delta_i)
    return torch.cat(parts, dim=2)


@_policy_rounds_alone
def backward(q, k, v, o_saved, lse, dout, *, scale: float, causal: bool | Visibility, policy: Precision,
             mods: ScoreMods | None = None):
    """Tiled backward (FlashAttention-2 Algorithm 2). Returns (dq, dk, dv) in the site formats."""
    r = _Rounder(policy, q.dtype, draw_seed() if rounds_backward_stochastically(policy) else None)
    vis = _visibility(causal, q, k)
    B, H, T, D = q.shape
    delta = _delta(r, q, k, v, o_saved, lse, dout, scale, vis, mods)
    # per tile, joined at the end (out of place, for torch.func's vmap)
    dq = {i0: torch.zeros(B, H, bm, D, dtype=r.dtype("dq"), device=q.device) for i0, bm in _tiles(T, policy.block_m)}
    dks, dvs = [], []
    for j0, bn in _tiles(k.shape[-2], policy.block_n):
        kj, vj = k[:, :, j0:j0 + bn], v[:, :, j0:j0 + bn]
        dk_j = torch.zeros(*kj.shape, dtype=r.dtype("dk"), device=q.device)
        dv_j = torch.zeros(*vj.shape, dtype=r.dtype("dv"), device=q.device)
        for i0, bm in _tiles(T, policy.block_m):
            if vis.skips(i0, bm, j0, bn):
                continue
            qi, doi = q[:, :, i0:i0 + bm], dout[:, :, i0:i0 + bm]
            s, capped = _scores_and_capped(r, qi, kj, scale, vis, i0, j0, mods)
            p = _probabilities(r, s, lse[:, :, i0:i0 + bm])
            p_op = r.site("p_operand", p)
            dv_j = r.site("dv", r.ew(torch.add, dv_j, r.mm(p_op.transpose(-1, -2), doi, "dv_part")))
            dp = r.mm(doi, vj.transpose(-1, -2), "dp")
            ds = r.site("ds", r.ew(torch.mul, p, r.ew(torch.sub, dp, delta[:, :, i0:i0 + bm])))
            if capped is not None:  # through the cap: d tanh(x) = 1 - tanh(x)^2
                tanh = r.up(capped) / mods.softcap
                ds = r.site("ds", r.up(ds) * (1 - tanh * tanh))
            ds_op = r.site("ds_operand", ds)
            dq_part = r.ew(lambda a: a * scale, r.mm(ds_op, kj, "dq_part"))
            dq[i0] = r.site("dq", r.ew(torch.add, dq[i0], dq_part))
            dk_part = r.ew(lambda a: a * scale, r.mm(ds_op.transpose(-1, -2), qi, "dk_part"))
            dk_j = r.site("dk", r.ew(torch.add, dk_j, dk_part))
        dks.append(dk_j)
        dvs.append(dv_j)
    return torch.cat(list(dq.values()), dim=2), torch.cat(dks, dim=2), torch.cat(dvs, dim=2)


def repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v with each head repeated for its group of query heads (GQA); autograd sums the group's gradients back
    in t's dtype."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _summed_over_groups(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """A (B, H, T, D) gradient of repeated k or v summed over each group, in its own dtype (the policy's site
    format), before the one cast to the input's dtype."""
    B, H, T, D = grad.shape
    return grad if H == heads else grad.reshape(B, heads, H // heads, T, D).sum(2)


class ReferenceAttention(torch.autograd.Function):
    """Autograd wrapper: the forward saves O (as the policy says) and the log-sum-exp; returns O and the natural-log
    lse (B, H, T) fp32 (not differentiable). k and v may have fewer heads than q (GQA): each query head reads its
    group's, and dK, dV are summed over the group in the policy's formats for them, then cast to the inputs' dtype
    once (so fp64 numerics give the exact gradient rounded once). In the `setup_context` form, with a generated vmap
    rule: torch.func's transforms (grad, vjp, vmap) apply."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, scale, causal, policy, stabilize, stats, heads, mods):
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        out, o_saved, lse = forward(q, k, v, scale=scale, causal=causal, policy=policy,
                                    stabilize=stabilize, stats=stats, heads=heads, mods=mods)
        # the O δ reads where it is not the output itself (an output twice would split its gradient)
        return out, (o_saved if o_saved is not out else out.new_empty(0)), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, scale, causal, policy, _, _, _, mods = inputs
        out, o_saved, lse = output
        ctx.save_for_backward(q, k, v, o_saved if o_saved.numel() else out, lse)
        ctx.scale, ctx.causal, ctx.policy, ctx.mods = scale, causal, policy, mods
        ctx.mark_non_differentiable(o_saved, lse)

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, o_saved, lse = ctx.saved_tensors
        H = q.shape[1]
        dq, dk, dv = backward(q, repeat_kv(k, H), repeat_kv(v, H), o_saved, lse, dout, scale=ctx.scale,
                              causal=ctx.causal, policy=ctx.policy, mods=ctx.mods)
        dk, dv = _summed_over_groups(dk, k.shape[1]), _summed_over_groups(dv, v.shape[1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def split_heads(q, k, v, policy: Precision, run):
    """Resolve a per-head override: `run(q, k, v, policy, heads)` on each group of heads, outputs re-interleaved.

    `heads` is the index tensor of the group (or `slice(None)` when there is no override),
    so per-head statistics land on the right heads. `run` returns a tensor or a tuple of tensors, each with the
    heads on dim 1; so does this.
    """
    if policy.head_override is None:
        return run(q, k, v, policy, slice(None))
    heads, other = policy.head_override
    H = q.shape[1]
    if any(h >= H for h in heads):
        raise ValueError(f"precision: head_override names heads {list(heads)}, but the input has {H} heads")
    base = policy.replace(head_override=None)
    chosen = torch.tensor(sorted(heads), dtype=torch.long, device=q.device)
    rest = torch.tensor([h for h in range(H) if h not in set(heads)], dtype=torch.long, device=q.device)
    parts, index = [], []
    for idx, pol in ((rest, base), (chosen, other)):
        if idx.numel() == 0:
            continue
        parts.append(run(*(t.index_select(1, idx) for t in (q, k, v)), pol, idx))
        index.append(idx)
    inverse = torch.argsort(torch.cat(index))
    single = not isinstance(parts[0], tuple)
    grouped = [(p,) if single else p for p in parts]
    merged = []
    for outputs in zip(*grouped):
        dtype = outputs[0].dtype if rest.numel() else outputs[-1].dtype
        merged.append(torch.cat([o.to(dtype) for o in outputs], dim=1).index_select(1, inverse))
    return merged[0] if single else tuple(merged)


def _mods_for(mods: ScoreMods | None, heads) -> ScoreMods | None:
    """`mods` for a group of heads (`heads`: an index tensor or every head): a per-head bias sliced to them."""
    if mods is None or mods.bias is None or isinstance(heads, slice) or mods.bias.shape[1] == 1:
        return mods
    return ScoreMods(mods.softcap, mods.bias.index_select(1, heads.to(mods.bias.device)))


def reference_attention(q, k, v, *, scale: float, causal: bool | Visibility, policy: Precision, stabilize=None,
                        stats: AttentionStats | None = None, mods: ScoreMods | None = None):
    """Reference attention with per-head policy overrides resolved: (O, lse (B, H, T), natural log, in fp32 or the
    policy's wider format)."""
    def run(q, k, v, pol, heads):
        out, _, lse = ReferenceAttention.apply(q, k, v, scale, causal, pol, stabilize, stats, heads,
                                               _mods_for(mods, heads))
        return out, lse[..., 0].to(torch.promote_types(lse.dtype, torch.float32))

    return split_heads(q, k, v, policy, run)


@_policy_rounds_alone
def forward_and_delta(q, k, v, dout, *, scale: float | None = None, causal: bool = True,
                      policy: Precision, stabilize=None, stats: AttentionStats | None = None,
                      row_flags: dict | None = None):
    """(O, δ) as the policy's forward and backward compute them; δ has shape (B, H, T). `row_flags`: `forward`'s."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, o_saved, lse = forward(q, k, v, scale=scale, causal=causal, policy=policy, stabilize=stabilize, stats=stats,
                                row_flags=row_flags)
    r = _Rounder(policy, q.dtype)
    delta = _delta(r, q, k, v, o_saved, lse, dout.to(out.dtype), scale, _visibility(causal, q, k))
    return out, delta.squeeze(-1)


@_policy_rounds_alone
def backward_row_sums(q, k, v, *, scale: float | None = None, causal: bool = True, policy: Precision) -> torch.Tensor:
    """(B, H, T) float64: each row's sum of the probabilities P = exp(S - lse) that the backward recomputes
    from the forward's saved log-sum-exp. 1 in exact arithmetic (0 for a fully masked row); when lse is rounded
    coarser than log(row sum) (bf16 at large logits) a row with k tied maxima sums to about k, and dV and dS
    grow with it."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    _, _, lse = forward(q, k, v, scale=scale, causal=causal, policy=policy)
    r = _Rounder(policy, q.dtype)
    vis = _visibility(causal, q, k)
    T = q.shape[-2]
    sums = torch.zeros(q.shape[:-1], dtype=torch.float64, device=q.device)
    for i0, bm in _tiles(T, policy.block_m):
        for j0, bn in _tiles(k.shape[-2], policy.block_n):
            if vis.skips(i0, bm, j0, bn):
                continue
            s = _scores(r, q[:, :, i0:i0 + bm], k[:, :, j0:j0 + bn], scale, vis, i0, j0)
            sums[:, :, i0:i0 + bm] += _probabilities(r, s, lse[:, :, i0:i0 + bm]).double().sum(-1)
    return sums
