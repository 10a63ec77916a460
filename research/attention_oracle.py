"""The oracle of research/attention_sweep.py: attention as a dense fp64 softmax, with masks built from their
definitions, two plain baselines in the inputs' dtype, and flash-attn's comparison rule."""

from __future__ import annotations

import math

import torch


def aligned_band(Tq: int, Tk: int, causal: bool, window: tuple[int, int], device) -> torch.Tensor:
    """(Tq, Tk) bool, True where query i sees key j: flash-attn's bottom-right alignment, j - i - (Tk - Tq) in
    [-left, right] (-1: unbounded), causal meaning right = 0."""
    i = torch.arange(Tq, device=device)[:, None]
    j = torch.arange(Tk, device=device)[None, :]
    offset = j - i - (Tk - Tq)
    left, right = window
    right = 0 if causal else right
    seen = torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    if right >= 0:
        seen &= offset <= right
    if left >= 0:
        seen &= offset >= -left
    return seen


def _per_query_head(t, heads: int):
    """k or v with each head repeated for its group of query heads; without groups, t itself (its memory as the call
    got it, so that a baseline sums in the same order as a call on the same tensors)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def scores(q, k, visible, scale: float, softcap: float = 0.0, bias=None, dtype=None):
    """S = scale q kᵀ, capped, then biased, hidden keys -inf: (B, H, Tq, Tk) in `dtype` (q's if None)."""
    dtype = dtype or q.dtype
    k = _per_query_head(k.to(dtype), q.shape[1])
    s = (q.to(dtype) @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(dtype)
    return s.masked_fill(~visible, -math.inf)


def dense(q, k, v, visible, scale: float, softcap: float = 0.0, bias=None, dtype=None):
    """softmax(S) V in (B, H, T, D) (`scores`), computed in `dtype` (q's if None). Returns O (rows without keys 0)
    and the fp64 log-sum-exp of S (-inf there)."""
    dtype = dtype or q.dtype
    s = scores(q, k, visible, scale, softcap, bias, dtype)
    v = _per_query_head(v.to(dtype), q.shape[1])
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return p @ v, torch.logsumexp(s.detach().double(), dim=-1)


class FlashPlain(torch.autograd.Function):
    """FlashAttention-2's arithmetic without tiles, stored in the inputs' dtype: scores and softmax in fp32 from
    the inputs, P rounded to the dtype for P V, O stored in it; the backward forms δ = rowsum(dO ∘ O) from the
    stored O, as flash backwards do, and rounds dS to the dtype before its products. A second plain baseline:
    where the exact gradient is far smaller than the dP - δ it cancels from, the dense dtype autograd can be lucky,
    and a flash backward's error is that of δ from the rounded O."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale, softcap, bias):
        f = torch.promote_types(q.dtype, torch.float32)
        groups = q.shape[1] // k.shape[1]
        Q, K, V = q.to(f), _per_query_head(k, q.shape[1]).to(f), _per_query_head(v, q.shape[1]).to(f)
        s = Q @ K.transpose(-1, -2) * scale
        tanh = None
        if softcap > 0:
            tanh = torch.tanh(s / softcap)
            s = softcap * tanh
        if bias is not None:
            s = s + bias.to(f)
        s = s.masked_fill(~visible, -math.inf)
        m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:-1], 1), -math.inf)
        empty = torch.isneginf(m)
        p = torch.exp(s - m.masked_fill(empty, 0.0))
        l = p.sum(-1, keepdim=True)
        probs = torch.where(empty, 0.0, p / l.masked_fill(empty, 1.0))
        o = torch.where(empty, 0.0, (p.to(q.dtype).to(f) @ V) / l.masked_fill(empty, 1.0)).to(q.dtype)
        ctx.save_for_backward(Q, K, V, probs, o, tanh)
        ctx.shape, ctx.groups, ctx.scale = k.shape, groups, scale
        return o

    @staticmethod
    def backward(ctx, dout):
        Q, K, V, probs, o, tanh = ctx.saved_tensors
        f, dtype = Q.dtype, o.dtype
        dO = dout.to(f)
        delta = (dO * o.to(f)).sum(-1, keepdim=True)
        ds = probs * (dO @ V.transpose(-1, -2) - delta)
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        ds = ds.to(dtype).to(f)
        dq = ctx.scale * ds @ K
        dk = ctx.scale * ds.transpose(-1, -2) @ Q
        dv = probs.to(dtype).to(f).transpose(-1, -2) @ dO
        B, H_kv, Tk, D = ctx.shape
        dk, dv = (t.reshape(B, H_kv, ctx.groups, Tk, t.shape[-1]).sum(2) for t in (dk, dv))
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, None


def attend(q, k, v, visible, scale: float, softcap: float, bias, how: str):
    """The oracle ("exact": fp64) or a baseline ("plain": dense in the inputs' dtype; "flash": `FlashPlain`)."""
    if how == "flash":
        return FlashPlain.apply(q, k, v, visible.expand(q.shape[0], q.shape[1], -1, -1), scale, softcap, bias), None
    return dense(q, k, v, visible, scale, softcap, bias, torch.float64 if how == "exact" else None)


class Check:
    """flash-attn's comparison rule, recorded per tensor."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.worst: dict[str, float] = {}
        self.failures: list[str] = []

    def close(self, name, ours, plains, exact, terms: float = 0.0):
        """`terms`: the size of the fp32 quantities whose rounding the atol also allows, one fp32 unit of it: for O
        the scores times |V| (`output_terms`), for a gradient the dP - δ it cancels from (`gradient_terms`; a row
        with one visible key has dQ = 0 exactly, which the plain dense backward gives but a flash backward, forming
        δ apart from dP, does not)."""
        if ours is None:
            self.failures.append(f"{name}: missing")
            return
        ours, exact = ours.detach().cpu().double(), exact.detach().cpu().double()
        if ours.shape != exact.shape:
            self.failures.append(f"{name}: shape {tuple(ours.shape)}, expected {tuple(exact.shape)}")
            return
        if not torch.isfinite(ours).all():
            self.failures.append(f"{name}: {int((~torch.isfinite(ours)).sum())} non-finite values")
            return
        if exact.numel() == 0:
            return
        scale = max(exact.abs().max().item(), 2.0 ** -10)
        atol = 2.0 ** math.floor(math.log2(scale)) * torch.finfo(self.dtype).eps  # one unit of the dtype at that size
        if terms > 0:
            atol = max(atol, 2.0 ** math.floor(math.log2(terms)) * torch.finfo(torch.float32).eps)
        plain = max((p.detach().cpu().double() - exact).abs().max().item() for p in plains)
        err, allowed = (ours - exact).abs().max().item(), 2 * plain + atol
        self.worst[name] = max(self.worst.get(name, 0.0), err / allowed)
        if err > allowed:
            self.failures.append(f"{name}: max error {err:.3g} > allowed {allowed:.3g}")

    def rounded_once(self, name, ours, exact, terms: float = 0.0):
        """Under fp64 numerics: the exact tensor rounded once to ours's dtype, each element within one unit in the
        last place there (fp64 results: within 1e-10 of the largest entry), or within 2^-44 of `terms`, the size of
        what cancels (`gradient_terms`): an entry far smaller than those keeps only fp64's absolute accuracy."""
        ours, exact = ours.detach().cpu(), exact.detach().cpu().double()
        if ours.shape != exact.shape:
            self.failures.append(f"{name}: shape {tuple(ours.shape)}, expected {tuple(exact.shape)}")
            return
        if ours.dtype == torch.float64:
            allowed = torch.full_like(exact, 1e-10 * (1 + (exact.abs().max().item() if exact.numel() else 0.0)))
        else:
            info = torch.finfo(ours.dtype)
            allowed = (info.eps * torch.exp2(exact.abs().clamp_min(info.tiny).log2().floor())).clamp_min(
                terms * 2.0**-44)
        err = (ours.double() - exact).abs()
        if err.numel():
            self.worst[name] = max(self.worst.get(name, 0.0), (err / allowed).max().item())
        if not (err <= allowed).all():
            self.failures.append(f"{name}: {int((err > allowed).sum())} values more than one unit from the exact ones")

    def lse(self, name, ours, exact):
        """-inf exactly where the exact one is; elsewhere within 1e-3 relative (scores in fp32 or wider)."""
        ours, exact = ours.detach().cpu().double(), exact.detach().cpu().double()
        if ours.shape != exact.shape:
            self.failures.append(f"{name}: shape {tuple(ours.shape)}, expected {tuple(exact.shape)}")
            return
        if not torch.equal(torch.isneginf(ours), torch.isneginf(exact)):
            self.failures.append(f"{name}: -inf at other rows than the exact one's")
            return
        finite = torch.isfinite(exact)
        if finite.any():
            err = ((ours - exact).abs() / (1 + exact.abs()))[finite].max().item()
            self.worst[name] = max(self.worst.get(name, 0.0), err / 1e-3)
            if err > 1e-3:
                self.failures.append(f"{name}: relative error {err:.3g} > 1e-3")


def check_statistics(check, stats, exact_scores, stabilized: bool) -> None:
    """An `AttentionStats` filled by one call, against what holds whatever the tiles: every query row counted;
    positive repeated-max rows within repeated-max rows within rows, and biasable rows within repeated-max rows;
    without a stabilizer, at least one P̄ = 1 per row that sees a key; the largest score the exact one's, within
    fp32 rounding of the scores."""
    B, H, Tq, _ = exact_scores.shape
    rows, repeated = stats.rows.cpu(), stats.repeated_max_rows.cpu()
    if not torch.equal(rows, torch.full((H,), B * Tq)):
        check.failures.append(f"stats.rows: {rows.tolist()}, expected {B * Tq} per head")
    if not ((stats.repeated_max_rows_positive.cpu() <= repeated) & (repeated <= rows)
            & (stats.biasable_rows.cpu() <= repeated)).all():
        check.failures.append(f"stats: counters out of order {stats.to_dict()}")
    finite = torch.isfinite(exact_scores)
    seeing = finite.any(-1).sum(dim=(0, 2)).cpu()
    if not stabilized and (stats.pbar_ones.cpu() < seeing).any():
        check.failures.append(f"stats.pbar_ones: {stats.pbar_ones.tolist()}, fewer than the rows that see a key "
                              f"{seeing.tolist()}")
    exact = exact_scores.masked_fill(~finite, -math.inf).amax(dim=(0, 2, 3)).cpu() if exact_scores.shape[-1] \
        else torch.full((H,), -math.inf, dtype=torch.float64)
    ours = stats.max_score.cpu().double()
    same_inf = torch.equal(torch.isneginf(ours), torch.isneginf(exact))
    finite_heads = torch.isfinite(exact)
    if not same_inf or ((ours - exact).abs() > 1e-4 * (1 + exact.abs()))[finite_heads].any():
        check.failures.append(f"stats.max_score: {ours.tolist()}, exact {exact.tolist()}")


def output_terms(exact_lse, q, k, v) -> float:
    """The size of what the fp32 rounding of the scores moves O by: the scores' own size (the log-sum-exp), or
    that of the products their dot products sum (|Q| |K| sqrt(D)), times |V|: an fp32 score of 64 is rounded by
    2^-18, and each P with it."""
    finite = exact_lse[torch.isfinite(exact_lse)]
    if not finite.numel() or not v.numel():
        return 0.0
    head_dim = q.shape[-1]
    q, k, v = (t.detach().double().abs().max().item() if t.numel() else 0.0 for t in (q, k, v))
    return max(finite.abs().max().item(), q * k * math.sqrt(head_dim)) * v


def gradient_terms(inputs, dout) -> float:
    """The size of the terms a gradient of attention sums and cancels: |dO| |V| max(|Q|, |K|) sqrt(D)."""
    if not dout.numel():
        return 0.0
    q, k, v = (t.detach().double().abs().max().item() if t.numel() else 0.0 for t in inputs)
    return dout.detach().double().abs().max().item() * v * max(q, k) * inputs[0].shape[-1] ** 0.5


def check_against_exact(check, ours_out, ours_grads, inputs, oracle, dout, grad_names, to_ours):
    """Output and gradients of a call against the fp64 oracle and the plain baselines: `oracle(how)` takes the
    call's leaves and gives (O, lse) in (B, H, T, D) form, `to_ours` maps that to the call's layout, and the
    gradients come back through autograd. Returns the exact lse."""
    exact_leaves = [t.detach().double().requires_grad_() for t in inputs]
    exact_out, exact_lse = oracle("exact")(*exact_leaves)
    # each baseline on contiguous copies and, where the call's inputs are not contiguous, on them as they are: an fp32
    # gradient's error moves with the summation order (a dense fp32 dQ's threefold between the two), and the rule's
    # baseline must not be one lucky order
    copies = [lambda t: t.clone(memory_format=torch.contiguous_format)]
    if not all(t.is_contiguous() for t in inputs):
        copies.append(lambda t: t)
    plains = []
    for how in ("plain", "flash"):
        for copy in copies:
            leaves = [copy(t.detach()).requires_grad_() for t in inputs]
            plains.append((leaves, oracle(how)(*leaves)[0]))
    check.close("out", ours_out, [to_ours(out) for _, out in plains], to_ours(exact_out),
                output_terms(exact_lse, *inputs))
    if ours_grads is not None:
        terms = gradient_terms(inputs, dout)
        exact_grads = torch.autograd.grad(to_ours(exact_out), exact_leaves, dout.double(), allow_unused=True)
        plain_grads = [torch.autograd.grad(to_ours(out), leaves, dout, allow_unused=True) for leaves, out in plains]
        for i, (name, o, e) in enumerate(zip(grad_names, ours_grads, exact_grads)):
            zero = torch.zeros_like(inputs[i] if e is None else e)
            check.close(name, o, [zero if g[i] is None else g[i] for g in plain_grads], zero if e is None else e,
                        terms)
    return exact_lse


def check_call(check, precision: str, ours_out, ours_grads, inputs, oracle, dout, grad_names, to_ours):
    """`check_against_exact`, or under fp64 numerics the exact result rounded once: O in fp64, each gradient in its
    input's dtype (`Check.rounded_once`). Returns the exact lse."""
    if precision != "fp64":
        return check_against_exact(check, ours_out, ours_grads, inputs, oracle, dout, grad_names, to_ours)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    exact_out, exact_lse = oracle("exact")(*leaves)
    check.rounded_once("out", ours_out, to_ours(exact_out))
    if ours_grads is not None:
        terms = gradient_terms(inputs, dout)
        exact_grads = torch.autograd.grad(to_ours(exact_out), leaves, dout.double(), allow_unused=True)
        for name, ours, exact, leaf in zip(grad_names, ours_grads, exact_grads, leaves):
            check.rounded_once(name, ours, torch.zeros_like(leaf) if exact is None else exact, terms)
    return exact_lse


def rotated(x, positions, cos, sin, mode: str):
    """flash-attn's rotary embedding of x (T, H, D) at positions (T,): its first R = 2 cos.shape[1] dims in pairs
    (x[2i], x[2i+1]) ("interleaved") or (x[i], x[i + R/2]) ("halves"), in fp32, cast back."""
    if mode == "none":
        return x
    R = 2 * cos.shape[1]
    wide = torch.promote_types(x.dtype, torch.float32)
    c, s = cos[positions].to(wide)[:, None], sin[positions].to(wide)[:, None]
    head = x[..., :R].to(wide)
    x1, x2 = (head[..., 0::2], head[..., 1::2]) if mode == "interleaved" else head.chunk(2, dim=-1)
    y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
    turned = torch.stack((y1, y2), -1).flatten(-2) if mode == "interleaved" else torch.cat((y1, y2), -1)
    return torch.cat((turned.to(x.dtype), x[..., R:]), -1)
