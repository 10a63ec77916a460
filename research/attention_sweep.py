"""A random differential sweep of the public attention calls against a dense fp64 softmax.

Each case draws one call (`flash_attention`, `sdpa`, the flash-attn calls: batched, packed, varlen and kv-cache) with
random sizes (odd ones, empty sequences, Tq > Tk), head dims 8-256, dtypes, GQA, masks, windows, softcap, SFA and
scales, and checks its output, log-sum-exp and gradients against softmax(S) V computed densely in fp64 from the
same inputs, with the masks built here from their definitions (not from the package's).

The rule is flash-attn's own: max |ours - exact| <= 2 max |plain - exact| + atol, where "plain" is the worse of two
baselines in the inputs' dtype (the same dense attention, and FlashAttention-2's arithmetic without tiles) and atol
one unit in the last place of that dtype at the exact tensor's largest entry (at least 2^-10), or one fp32 unit of
what the fp32 arithmetic rounds (for O the scores' terms times |V|, for a gradient the terms it cancels from): with
fp32 inputs the baselines compute no coarser than the calls, and 2x alone leaves no room for that rounding. Rows
that see no key are exact: O = 0, lse = -inf, no gradient. Under fp64 numerics a call must give the exact result
rounded once. The kv-cache call's in-place writes are checked too.

On the CPU the calls take the reference (the package's tiled PyTorch path); on a GPU the fused kernels, the decoding
kernel and the packed kernels. Every case has its own seed: `--only SEED` runs that one case again.

    python research/attention_sweep.py --cases 400 --out sweep.json            # CPU
    python research/attention_sweep.py --device cuda --budget-s 300 --out sweep.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from attention_oracle import (
    Check,
    aligned_band,
    attend,
    check_call,
    check_statistics,
    output_terms,
    rotated,
    scores,
)

from stableflash import (
    SFA,
    AttentionStats,
    flash_attention,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    route_sdpa,
    sdpa,
)

HEAD_DIMS = (8, 16, 24, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 256)
TARGETS = ("flash_attention", "sdpa", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")


class Draw:
    """One case's random choices, from its seed alone, each recorded in `params` as it is made."""

    def __init__(self, seed: int, device: str, max_len: int):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.max_len = device, max_len
        self.params: dict = {}

    def pick(self, name, choices):
        value = self.rng.choice(list(choices))
        self.params[name] = value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
        return value

    def length(self, name, allow_zero=False):
        r = self.rng.random()
        if allow_zero and r < 0.05:
            value = 0
        elif r < 0.3:
            value = self.rng.randint(1, 8)
        else:
            value = self.rng.randint(1, self.max_len)
        self.params[name] = value
        return value

    def heads(self):
        H_kv = self.pick("H_kv", (1, 1, 2, 3))
        return self.pick("group", (1, 1, 2, 4)) * H_kv, H_kv

    def window(self):
        if self.rng.random() < 0.6:
            self.params["window"] = (-1, -1)
            return (-1, -1)
        w = (self.rng.choice((-1, 0, 1, 7, 33)), self.rng.choice((-1, 0, 1, 7, 33)))
        self.params["window"] = w
        return w

    def tensor(self, *shape, dtype, magnitude=1.0):
        return (torch.randn(*shape, generator=self.gen) * magnitude).to(dtype).to(self.device)

    def memory(self):
        return self.pick("memory", ("contiguous", "contiguous", "sliced", "permuted", "strided"))


def stored(t: torch.Tensor, memory: str) -> torch.Tensor:
    """A 4-D t's values in other memory: "sliced", a view into a larger tensor (one more of dim 1, eight more of the
    last) whose other entries are NaN, so that a read outside the view shows in the output; "permuted", stored in
    (0, 2, 1, 3) order; "strided", every other element of a tensor twice as wide, NaN between (the last dim's
    stride 2). A leaf, as the call's inputs are."""
    if memory == "strided":
        return torch.stack([t, torch.full_like(t, float("nan"))], dim=-1).flatten(-2)[..., ::2]
    if memory == "sliced":
        base = torch.full((t.shape[0], t.shape[1] + 1, t.shape[2], t.shape[3] + 8), float("nan"), dtype=t.dtype,
                          device=t.device)
        view = base[:, 1:, :, 3:3 + t.shape[3]]
        view.copy_(t)
        return view
    if memory == "permuted":
        return t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    return t.contiguous()


def _same(t):
    return t


def _swap_t_and_h(t):  # (B, T, H, D) <-> (B, H, T, D)
    return t.transpose(1, 2)


def _batched(t):
    return t.unsqueeze(0)


def _unbatched(t):
    return t[0]


def _from_packed(t):  # (T, H, D) -> (1, H, T, D)
    return t.transpose(0, 1)[None]


def _to_packed(t):
    return t[0].transpose(0, 1)


def _leaves(*tensors):
    return [t.requires_grad_() for t in tensors]


def case_flash_attention(d: Draw, dtype):
    B, (H, H_kv), D = d.pick("B", (1, 2, 3)), d.heads(), d.pick("D", HEAD_DIMS)
    Tq, Tk = d.length("Tq"), d.length("Tk")
    causal, window = d.pick("causal", (True, False)), d.window()
    softcap = d.pick("softcap", (0.0, 0.0, 0.0, 5.0, 30.0))
    magnitude = d.pick("magnitude", (1.0, 1.0, 4.0))
    stabilize = d.pick("stabilize", (None, None, SFA()))
    layout = d.pick("layout", ("bhtd", "bthd"))
    padded = d.pick("key_padding", (False, False, True))
    mask_kind = d.pick("attn_mask", ("none", "none", "none", "bool", "float"))
    scale = d.pick("scale", (None, None, 0.3))
    return_lse = d.pick("return_lse", (True, False))
    stats = AttentionStats(H) if d.pick("stats", (False, False, True)) else None
    memory, with_grad = d.memory(), d.pick("grad", (True, True, True, False))
    precision = d.pick("precision", ("fa2", "fa2", "fa2", "fa2", "fp64"))
    q = d.tensor(B, H, Tq, D, dtype=dtype, magnitude=magnitude)
    k, v = d.tensor(B, H_kv, Tk, D, dtype=dtype, magnitude=magnitude), d.tensor(B, H_kv, Tk, D, dtype=dtype)
    dout = d.tensor(B, H, Tq, D, dtype=dtype)
    padding = (torch.rand(B, Tk, generator=d.gen) < 0.8).to(d.device) if padded else None
    attn_mask, bias = None, None
    visible = aligned_band(Tq, Tk, causal, window, d.device).expand(B, H, Tq, Tk)
    if padding is not None:
        visible = visible & padding[:, None, None, :]
    if mask_kind == "bool":
        attn_mask = (torch.rand(1, H, Tq, Tk, generator=d.gen) < 0.85).to(d.device)
        visible = visible & attn_mask
    elif mask_kind == "float":
        attn_mask = (torch.randn(B, 1, Tq, Tk, generator=d.gen) * 2).to(dtype).to(d.device)
        bias = attn_mask
    s = scale if scale is not None else D ** -0.5
    to_layout = _swap_t_and_h if layout == "bthd" else _same
    qi, ki, vi = _leaves(*(stored(to_layout(t), memory) for t in (q, k, v)))
    with torch.set_grad_enabled(with_grad):  # without: on a GPU, few queries against more keys take the decoding kernel
        result = flash_attention(qi, ki, vi, causal=causal, window=window, key_padding_mask=padding,
                                 attn_mask=attn_mask, softcap=softcap, stabilize=stabilize, scale=scale,
                                 return_lse=return_lse, layout=layout, stats=stats, precision=precision)
    out, lse = result if return_lse else (result, None)
    grads = torch.autograd.grad(out, (qi, ki, vi), to_layout(dout).to(out.dtype)) if with_grad else None
    check = Check(dtype)

    def oracle(how):
        return lambda q_, k_, v_: attend(to_layout(q_), to_layout(k_), to_layout(v_), visible, s, softcap, bias, how)
    exact_lse = check_call(check, precision, out, grads, (qi, ki, vi), oracle, to_layout(dout), ("dq", "dk", "dv"),
                           to_layout)
    if return_lse:
        check.lse("lse", lse, exact_lse)
    if stats is not None:
        check_statistics(check, stats, scores(q.double(), k.double(), visible, s, softcap, bias), stabilize is not None)
    return check


def case_sdpa(d: Draw, dtype):
    batched = d.pick("batched", (True, True, False))
    B, (H, H_kv), D = d.pick("B", (1, 2)), d.heads(), d.pick("D", HEAD_DIMS)
    L, S = d.length("L", allow_zero=True), d.length("S", allow_zero=True)
    kind = d.pick("mask", ("causal", "none", "bool", "float"))
    scale = d.pick("scale", (None, 0.5))
    lead = (B,) if batched else ()
    memory = d.memory() if batched else "contiguous"
    q = stored(d.tensor(*lead, H, L, D, dtype=dtype), memory) if batched else d.tensor(H, L, D, dtype=dtype)
    k, v = (stored(d.tensor(*lead, H_kv, S, D, dtype=dtype), memory) if batched else d.tensor(H_kv, S, D, dtype=dtype)
            for _ in range(2))
    dout = d.tensor(*lead, H, L, D, dtype=dtype)
    attn_mask, bias = None, None
    visible = torch.ones(1, 1, L, S, dtype=torch.bool, device=d.device)
    if kind == "causal":
        visible = torch.ones(L, S, dtype=torch.bool, device=d.device).tril()[None, None]  # SDPA's: top left
    elif kind == "bool":
        attn_mask = (torch.rand(L, S, generator=d.gen) < 0.8).to(d.device)
        visible = attn_mask[None, None]
    elif kind == "float":
        attn_mask = torch.randn(L, S, generator=d.gen).to(dtype).to(d.device)
        bias = attn_mask
    precision = d.pick("precision", ("fa2", "fa2", "fa2", "fa2", "fp64"))
    qi, ki, vi = _leaves(q, k, v)
    call = dict(attn_mask=attn_mask, is_causal=kind == "causal", scale=scale, enable_gqa=H_kv != H)
    if d.pick("routed", (False, True)):  # torch's own function, routed through stableflash for the call
        with route_sdpa(precision=precision):
            out = F.scaled_dot_product_attention(qi, ki, vi, **call)
    else:
        out = sdpa(qi, ki, vi, **call, precision=precision)
    grads = torch.autograd.grad(out, (qi, ki, vi), dout.to(out.dtype)) if out.numel() else None
    s = scale if scale is not None else D ** -0.5
    batch, unbatch = (_same, _same) if batched else (_batched, _unbatched)
    check = Check(dtype)

    def oracle(how):
        return lambda q_, k_, v_: attend(batch(q_), batch(k_), batch(v_), visible, s, 0.0,
                                         None if bias is None else bias[None, None], how)
    check_call(check, precision, out, grads, (qi, ki, vi), oracle, dout, ("dq", "dk", "dv"), unbatch)
    return check


def case_flash_attn_func(d: Draw, dtype):
    B, (H, H_kv), D = d.pick("B", (1, 2, 3)), d.heads(), d.pick("D", HEAD_DIMS)
    packing = d.pick("packing", ("none", "none", "kv", "qkv"))
    Tq = d.length("Tq")
    Tk = Tq if packing == "qkv" else d.length("Tk")
    if packing == "qkv":
        H_kv = H
        d.params["H_kv"] = H
    causal, window = d.pick("causal", (True, False)), d.window()
    softcap = d.pick("softcap", (0.0, 0.0, 10.0))
    precision = d.pick("precision", ("fa2", "fa2", "fa2", "fa2", "fp64"))
    memory = d.memory() if packing == "none" else "contiguous"
    q = d.tensor(B, Tq, H, D, dtype=dtype)
    k, v = d.tensor(B, Tk, H_kv, D, dtype=dtype), d.tensor(B, Tk, H_kv, D, dtype=dtype)
    dout = d.tensor(B, Tq, H, D, dtype=dtype)
    common = dict(causal=causal, window_size=window, softcap=softcap, return_attn_probs=True, precision=precision)
    qi, ki, vi = _leaves(*(stored(t, memory) for t in (q, k, v)))
    if packing == "none":
        out, lse, _ = flash_attn_func(qi, ki, vi, **common)
    elif packing == "kv":
        out, lse, _ = flash_attn_kvpacked_func(qi, torch.stack((ki, vi), dim=2), **common)
    else:
        out, lse, _ = flash_attn_qkvpacked_func(torch.stack((qi, ki, vi), dim=2), **common)
    grads = torch.autograd.grad(out, (qi, ki, vi), dout.to(out.dtype))
    visible = aligned_band(Tq, Tk, causal, window, d.device)
    bhtd = _swap_t_and_h
    check = Check(dtype)

    def oracle(how):
        return lambda q_, k_, v_: attend(bhtd(q_), bhtd(k_), bhtd(v_), visible, D ** -0.5, softcap, None, how)
    exact_lse = check_call(check, precision, out, grads, (qi, ki, vi), oracle, dout, ("dq", "dk", "dv"), bhtd)
    check.lse("lse", lse, exact_lse)
    return check


def case_flash_attn_varlen_func(d: Draw, dtype):
    (H, H_kv), D = d.heads(), d.pick("D", HEAD_DIMS)
    count = d.pick("sequences", (1, 2, 3, 5))
    lengths = [(d.length(f"Tq{b}", allow_zero=True), d.length(f"Tk{b}", allow_zero=True)) for b in range(count)]
    causal, window = d.pick("causal", (True, False)), d.window()
    softcap = d.pick("softcap", (0.0, 0.0, 10.0))
    paged = d.pick("paged", (False, False, True))
    precision = d.pick("precision", ("fa2", "fa2", "fa2", "fa2", "fp64"))
    tq, tk = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    q, dout = d.tensor(tq, H, D, dtype=dtype), d.tensor(tq, H, D, dtype=dtype)
    k, v = d.tensor(tk, H_kv, D, dtype=dtype), d.tensor(tk, H_kv, D, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor([a for a, _ in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([b for _, b in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    cu_q, cu_k = cu_q.to(d.device), cu_k.to(d.device)
    max_q, max_k = max(a for a, _ in lengths), max(b for _, b in lengths)
    qi, ki, vi = _leaves(q, k, v)
    common = dict(causal=causal, window_size=window, softcap=softcap, return_attn_probs=True, precision=precision)
    if paged:  # each sequence's keys on pages of 16, the pages shuffled in one pool
        page = 16
        pages_per = [max(1, -(-b // page)) for _, b in lengths]
        order = list(range(sum(pages_per)))
        d.rng.shuffle(order)
        k_pages = torch.zeros(len(order), page, H_kv, D, dtype=dtype, device=d.device)
        v_pages = torch.zeros_like(k_pages)
        table = torch.zeros(count, max(pages_per), dtype=torch.int32)
        used, start = 0, 0
        for b, (_, n) in enumerate(lengths):
            for p in range(pages_per[b]):
                slot = order[used]
                used += 1
                table[b, p] = slot
                rows = slice(start + p * page, min(start + (p + 1) * page, start + n))
                width = rows.stop - rows.start
                if width > 0:
                    k_pages[slot, :width] = k[rows]
                    v_pages[slot, :width] = v[rows]
            start += n
        out, lse, _ = flash_attn_varlen_func(qi, k_pages, v_pages, cu_q, cu_k, max_q, max_k,
                                             block_table=table.to(d.device), **common)
        grads = torch.autograd.grad(out, qi, dout.to(out.dtype)) if tq else None  # the pages are not the leaves
    else:
        out, lse, _ = flash_attn_varlen_func(qi, ki, vi, cu_q, cu_k, max_q, max_k, **common)
        grads = torch.autograd.grad(out, (qi, ki, vi), dout.to(out.dtype), allow_unused=True) if tq else None
    # the oracle: one block-diagonal dense attention over the packed tokens
    visible = torch.zeros(tq, tk, dtype=torch.bool, device=d.device)
    for (a, b), q0, k0 in zip(lengths, cu_q.tolist(), cu_k.tolist()):
        visible[q0:q0 + a, k0:k0 + b] = aligned_band(a, b, causal, window, d.device)
    packed, unpacked = _from_packed, _to_packed
    check = Check(dtype)

    def oracle(how):
        return lambda q_, k_, v_: attend(packed(q_), packed(k_), packed(v_), visible, D ** -0.5, softcap, None, how)
    names = ("dq",) if paged else ("dq", "dk", "dv")
    exact_lse = check_call(check, precision, out, grads, (qi, ki, vi), oracle, dout, names, unpacked)
    check.lse("lse", lse, exact_lse[0])
    return check


def case_flash_attn_with_kvcache(d: Draw, dtype):
    B, (H, H_kv), D = d.pick("B", (1, 2, 3)), d.heads(), d.pick("D", HEAD_DIMS)
    Tq = d.pick("Tq", (1, 1, 2, 5))
    new = d.pick("new", (0, 0, 1, Tq))
    page = d.pick("page", (None, None, 8, 16))  # None: a cache row per sequence, else pages through a block table
    capacity = d.length("capacity") + new + 8
    capacity = capacity if page is None else -(-capacity // page) * page
    d.params["capacity"] = capacity
    seqlens = [d.rng.randint(0, capacity - new) for _ in range(B)]
    starts = [d.rng.randint(0, s + new) for s in seqlens] if d.pick("leftpad", (False, False, True)) else None
    rows = list(range(B))  # each sequence's cache row (cache_batch_idx; flash-attn takes it without pages only)
    if page is None and d.pick("cache_batch_idx", (False, False, True)):
        d.rng.shuffle(rows)
    d.params.update(cache_seqlens=seqlens, starts=starts, rows=rows)
    causal, window = d.pick("causal", (True, False)), d.window()
    softcap = d.pick("softcap", (0.0, 0.0, 10.0))
    rotary = d.pick("rotary", ("none", "none", "interleaved", "halves")) if D >= 4 else "none"
    precision = d.pick("precision", ("fa2", "fa2", "fa2", "fa2", "fp64"))
    memory = d.memory()
    q = stored(d.tensor(B, Tq, H, D, dtype=dtype), memory)
    k_cache, v_cache = (stored(d.tensor(B, capacity, H_kv, D, dtype=dtype), memory) for _ in range(2))
    k_new, v_new = (stored(d.tensor(B, new, H_kv, D, dtype=dtype), memory) if new else None for _ in range(2))
    cos = sin = None
    if rotary != "none":
        R = 2 * (D // 4)
        angles = torch.arange(capacity + Tq + 1.0)[:, None] * (1e-2 * torch.arange(1, R // 2 + 1.0))[None]
        cos, sin = angles.cos().to(dtype).to(d.device), angles.sin().to(dtype).to(d.device)

    # what the cache holds after the call, built here: the new keys (rotated) written after each sequence's keys
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b in range(B):
        written = slice(seqlens[b], seqlens[b] + new)
        if new:
            expected_k[rows[b], written] = rotated(k_new[b], torch.arange(written.start, written.stop,
                                                                          device=d.device), cos, sin, rotary)
            expected_v[rows[b], written] = v_new[b]
    if page is None:
        cache_args = dict(k_cache=k_cache, v_cache=v_cache,
                          cache_batch_idx=torch.tensor(rows, dtype=torch.int32, device=d.device)
                          if rows != list(range(B)) else None)
    else:  # each sequence's row cut into pages, the pages shuffled in one pool
        order = list(range(B * (capacity // page)))
        d.rng.shuffle(order)
        table = torch.tensor(order, dtype=torch.int32, device=d.device).reshape(B, -1).long()
        pool_k, pool_v = (stored(torch.zeros(len(order), page, H_kv, D, dtype=dtype, device=d.device), memory)
                          for _ in range(2))
        pool_k[table], pool_v[table] = (c.reshape(B, -1, page, H_kv, D) for c in (k_cache, v_cache))
        cache_args = dict(k_cache=pool_k, v_cache=pool_v, block_table=table.int())
    out, lse = flash_attn_with_kvcache(
        q, **cache_args, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=d.device),
        cache_leftpad=None if starts is None else torch.tensor(starts, dtype=torch.int32, device=d.device),
        causal=causal, window_size=window, softcap=softcap, rotary_interleaved=rotary == "interleaved",
        return_softmax_lse=True, precision=precision)
    check = Check(dtype)
    written_k, written_v = ((k_cache, v_cache) if page is None else
                            (pool[table].reshape(B, capacity, H_kv, D) for pool in (pool_k, pool_v)))
    if not (torch.equal(written_k, expected_k) and torch.equal(written_v, expected_v)):
        check.failures.append("cache: the in-place writes differ from the expected cache")
    # each sequence's queries (rotated at their positions when causal or windowed, else all at the cache's end)
    # against its keys from its left padding on, causal to its own last key
    outs = {"exact": [], "plain": [], "flash": []}
    exact_lses = []
    aligned = causal or window != (-1, -1)
    for b in range(B):
        first, seen = (0 if starts is None else starts[b]), seqlens[b] + new
        offsets = torch.arange(Tq, device=d.device) if aligned else torch.zeros(Tq, dtype=torch.long, device=d.device)
        qb = rotated(q[b], seqlens[b] + offsets, cos, sin, rotary)
        bhtd = [_from_packed(t) for t in (qb, expected_k[rows[b], first:seen], expected_v[rows[b], first:seen])]
        visible = aligned_band(Tq, seen - first, causal, window, d.device)
        for how in outs:
            o, lse_b = attend(*bhtd, visible, D ** -0.5, softcap, None, how)
            outs[how].append(_to_packed(o))
            if how == "exact":
                exact_lses.append(lse_b[0])
    exact_lse = torch.stack(exact_lses)
    if precision == "fp64":
        check.rounded_once("out", out, torch.stack(outs["exact"]))
    else:
        check.close("out", out, [torch.stack(outs["plain"]), torch.stack(outs["flash"])], torch.stack(outs["exact"]),
                    output_terms(exact_lse, q, k_cache, v_cache))
    check.lse("lse", lse, exact_lse)
    return check


CASES = {"flash_attention": case_flash_attention, "sdpa": case_sdpa, "flash_attn_func": case_flash_attn_func,
         "flash_attn_varlen_func": case_flash_attn_varlen_func, "flash_attn_with_kvcache": case_flash_attn_with_kvcache}


# the kernels' other implementations of the same numerics (`KernelOptions`), one per case on a GPU
KERNEL_OPTIONS = ({}, {}, {}, {"atomic_dq": True}, {"group_sum_in_program": False}, {"hopper_forward": False},
                  {"decode_kernel": False}, {"tma": False})


def run_case(seed: int, device: str, max_len: int, targets) -> dict:
    d = Draw(seed, device, max_len)
    target = d.pick("target", targets)
    dtypes = (torch.bfloat16, torch.float16) if device != "cpu" else (torch.bfloat16, torch.float16, torch.float32)
    dtype = d.pick("dtype", dtypes)
    options = d.pick("kernel_options", KERNEL_OPTIONS) if device != "cpu" else {}
    record = {"seed": seed, "params": d.params}
    try:
        with _kernel_options(**options):
            check = CASES[target](d, dtype)
        record["failures"], record["worst"] = check.failures, check.worst
    except Exception as e:  # noqa: BLE001 - a raising call is a finding, recorded with its case
        record["failures"] = [f"raised {type(e).__name__}: {e}"]
        record["traceback"] = traceback.format_exc(limit=-4)
    return record


def _kernel_options(**changes):
    if not changes:
        return contextlib.nullcontext()
    from stableflash.attention.triton import kernel_options
    return kernel_options(**changes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new cases after this long")
    parser.add_argument("--seed", type=int, default=0, help="case i runs seed SEED + i")
    parser.add_argument("--only", type=int, default=None,
                        help="run this one case seed again (with the run's --device, --targets and --max-len: the "
                             "draws depend on them)")
    parser.add_argument("--max-len", type=int, default=None, help="longest drawn sequence (CPU 160, GPU 1200)")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--autotune", action="store_true",
                        help="on a GPU, autotune each new shape as a user's first call does (default: each kernel's "
                             "first tile, as the tests run, so that the budget goes to cases)")
    parser.add_argument("--out", default=None, help="JSON: every case's parameters and worst error ratios")
    args = parser.parse_args(argv)
    targets = tuple(args.targets.split(","))
    unknown = set(targets) - set(TARGETS)
    if unknown:
        parser.error(f"--targets: unknown {sorted(unknown)}; expected some of {list(TARGETS)}")
    max_len = args.max_len or (160 if args.device == "cpu" else 1200)
    if args.device != "cpu" and not args.autotune:
        from stableflash.attention.triton import set_kernel_options
        set_kernel_options(autotune=False)
    seeds = [args.only] if args.only is not None else [args.seed + i for i in range(args.cases)]
    start, records = time.perf_counter(), []
    for seed in seeds:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            break
        record = run_case(seed, args.device, max_len, targets)
        records.append(record)
        if record["failures"]:
            print(f"seed {seed} {record['params']}: {'; '.join(record['failures'])}", flush=True)
            if args.only is not None and "traceback" in record:
                print(record["traceback"])
    failed = [r for r in records if r["failures"]]
    by_target = {t: sum(r["params"]["target"] == t for r in records) for t in targets}
    worst = max((max(r["worst"].values(), default=0.0) for r in records if "worst" in r), default=0.0)
    summary = {"device": args.device, "torch": torch.__version__, "cases": len(records), "failed": len(failed),
               "by_target": by_target, "worst_error_over_allowed": worst,
               "seconds": round(time.perf_counter() - start, 1), "max_len": max_len}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "cases": records}, f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
