"""Five `transformers` architectures with `"stableflash"` against their own attention, and decoding speed.

Llama (GQA), Mistral (a sliding window), Qwen2 (biased projections), Gemma 2 (softcap, alternating windows) and
GPT-2, each built twice from one seed: once with `"stableflash"`, once with the baseline transformers runs it with
(`"sdpa"`; Gemma 2's is `"eager"`, as transformers gives it no SDPA path). Per model:
- forward logits and backward gradients on a padded batch: the relative error against the baseline's;
- greedy `generate` from a left-padded batch: whether the tokens are equal, and where they first differ, the
  baseline's own margin between its top two logits there (a near-tie in bf16 is not a wrong token);
- `torch.compile(fullgraph=True)` of the stableflash model: a forward and backward, or the error (and the
  baseline's, which tells the model's own code from the attention);
- on a GPU, the time of a greedy `generate` of `--new-tokens` tokens after a `--prompt`-token prompt, against the
  baseline in interleaved rounds.
Then the attention of one decoding step alone (one query per sequence against a long cache): `flash_attn_with_kvcache`
(the decoding kernel with its own split count and with more splits, on a dense and a paged cache, and the flash
kernels) against SDPA, with the cache bytes read per second. On a GPU the models run in bf16 through the fused
kernels; on the CPU in fp32 through the reference (small shapes, no timing).

    python benchmarks/transformers_models.py --out results/drop-ins/transformers-models.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import run_meta  # benchmarks/common.py: the script's own folder is on sys.path
from transformers import AutoModelForCausalLM, Gemma2Config, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from stableflash.attention import flash_attn_with_kvcache
from stableflash.integrations.transformers import register


def configs(width: int, heads: int, vocab: int, positions: int) -> dict:
    kv = max(1, heads // 4)
    shared = dict(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=positions,
                  initializer_range=0.1)
    return {
        "llama": LlamaConfig(**shared),
        "mistral": MistralConfig(**shared, sliding_window=64),
        "qwen2": Qwen2Config(**shared),
        "gemma2": Gemma2Config(**shared, head_dim=width // heads, sliding_window=64, attn_logit_softcapping=50.0,
                               query_pre_attn_scalar=width // heads),
        "gpt2": GPT2Config(vocab_size=vocab, n_embd=width, n_layer=2, n_head=heads, n_positions=positions,
                           attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, initializer_range=0.1),
    }


def baseline_of(name: str) -> str:
    return "eager" if name == "gemma2" else "sdpa"


def build(config, impl: str, device, dtype):
    torch.manual_seed(0)  # a copy of the config: building a model records its attention implementation there
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).to(device=device, dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def padded_batch(vocab: int, batch: int, length: int, device, left: bool):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch, length), generator=generator).to(device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    if left:
        mask[1, : length // 4] = 0
    else:
        mask[1, 3 * length // 4:] = 0
    return ids, mask


def logits_and_grads(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    logits[real].float().square().mean().backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return logits.detach()[real], grads


def greedy(model, ids, mask, new_tokens: int):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)  # (B, new), (B, new, vocab)


def compare_generation(ours, theirs) -> dict:
    tokens, _ = ours
    base_tokens, base_scores = theirs
    differ = (tokens != base_tokens).nonzero()
    if differ.numel() == 0:
        return {"tokens_equal": True}
    b, step = differ[0].tolist()  # the first difference of row b (later steps follow other prefixes)
    top2 = base_scores[b, step].float().topk(2).values
    spread = base_scores[b, step].float().std().item()
    return {"tokens_equal": False, "first_difference": {"row": b, "step": step},
            "baseline_top2_margin": (top2[0] - top2[1]).item(), "baseline_logit_std": spread,
            "near_tie": bool((top2[0] - top2[1]).item() < 0.05 * spread)}


def fullgraph(model, ids) -> str:
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True)  # the logits (transformers' loss helper logs: not whole)
        logits = compiled(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
        return "ok" if torch.isfinite(loss) else "non-finite loss"
    except Exception as error:  # noqa: BLE001 - reported in its row
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def decode_seconds(model, ids, new_tokens: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_attention(batch: int, heads: int, kv_heads: int, cache: int, head_dim: int, rounds: int) -> dict:
    """One decoding step's attention: q (B, 1, H, D) against a (B, cache, H_kv, D) bf16 cache, through
    `flash_attn_with_kvcache` (the split-KV decoding kernel with its own split count, and with enough splits for 8
    programs per SM; the same cache in pages of 256 read through a block table; and the flash kernels, with the
    decoding kernel switched off) against SDPA on the same cache."""
    import triton.testing

    from stableflash.attention.triton import kernel_options

    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(batch, cache, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    page = 256
    table = torch.arange(batch * cache // page, device="cuda", dtype=torch.int32).reshape(batch, -1)
    k_pages, v_pages = (t.reshape(-1, page, kv_heads, head_dim) for t in (k, v))
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))

    def flash_kernels():
        with kernel_options(decode_kernel=False):
            return flash_attn_with_kvcache(q, k, v, causal=True)

    more = -(-8 * torch.cuda.get_device_properties(0).multi_processor_count // (batch * kv_heads))
    arms = {"stableflash": lambda: flash_attn_with_kvcache(q, k, v, causal=True),
            "stableflash_8_per_sm": lambda: flash_attn_with_kvcache(q, k, v, causal=True, num_splits=more),
            "stableflash_paged": lambda: flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table, causal=True),
            "flash_kernels": flash_kernels,
            "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=kv_heads != heads)}
    expected = arms["sdpa"]().transpose(1, 2)
    errors = {name: rel(arm(), expected) for name, arm in arms.items() if name != "sdpa"}
    times = {name: [] for name in arms}
    with torch.no_grad():
        for _ in range(rounds):
            for name, arm in arms.items():
                times[name].append(triton.testing.do_bench(arm, warmup=25, rep=100))
    cache_bytes = 2 * k.numel() * k.element_size()
    ms = {name: statistics.median(t) for name, t in times.items()}
    return {"shape": {"batch": batch, "heads": heads, "kv_heads": kv_heads, "cache": cache, "head_dim": head_dim},
            "relative_error_to_sdpa": errors, "ms": ms,
            "ratio_to_sdpa": {name: ms["sdpa"] / t for name, t in ms.items() if name != "sdpa"},
            "cache_gb_per_s": {name: cache_bytes / (t * 1e-3) / 1e9 for name, t in ms.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="llama,mistral,qwen2,gemma2,gpt2")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the timed generate (GPU)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    register()
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    width, heads, vocab = (512, 8, 1024) if gpu else (64, 4, 97)
    positions = args.prompt + args.new_tokens if gpu else 64
    rows, decode = [], []
    meta = run_meta() | {k: v for k, v in vars(args).items() if k != "out"} | {
        "device": device, "dtype": str(dtype), "width": width, "heads": heads,
        "timing": "generate: wall time, synchronised, interleaved rounds, median; attention: triton do_bench median"}

    def write():  # after every model: a call cut short keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "models": rows, "decode_attention": decode}, indent=2))

    for name, config in configs(width, heads, vocab, positions).items():
        if name not in args.models.split(","):
            continue
        base = baseline_of(name)
        ours_model, base_model = build(config, "stableflash", device, dtype), build(config, base, device, dtype)
        ids, mask = padded_batch(vocab, 3, 96 if gpu else 19, device, left=False)
        ours, theirs = logits_and_grads(ours_model, ids, mask), logits_and_grads(base_model, ids, mask)
        row = {"model": name, "baseline": base, "logits_rel_error": rel(ours[0], theirs[0]),
               "grads_rel_error": rel(ours[1], theirs[1])}
        ids, mask = padded_batch(vocab, 3, 40 if gpu else 9, device, left=True)
        with torch.no_grad():
            row["generate"] = compare_generation(greedy(ours_model, ids, mask, 24), greedy(base_model, ids, mask, 24))
        compile_ids = padded_batch(vocab, 2, 64 if gpu else 16, device, left=False)[0]
        row["fullgraph"] = fullgraph(ours_model, compile_ids)
        row["baseline_fullgraph"] = fullgraph(base_model, compile_ids)  # whether the model's own code compiles whole
        if gpu:
            prompt = padded_batch(vocab, 4, args.prompt, device, left=False)[0]
            with torch.no_grad():
                for model in (ours_model, base_model):
                    decode_seconds(model, prompt, 4)  # warm: kernels compiled, tiles picked
                seconds = {"stableflash": [], base: []}
                for _ in range(args.rounds):
                    seconds["stableflash"].append(decode_seconds(ours_model, prompt, args.new_tokens))
                    seconds[base].append(decode_seconds(base_model, prompt, args.new_tokens))
            row["decode_tokens_per_s"] = {k: 4 * args.new_tokens / statistics.median(v) for k, v in seconds.items()}
            row["decode_ratio_to_baseline"] = statistics.median(s / o for s, o in zip(seconds[base],
                                                                                       seconds["stableflash"]))
        rows.append(row)
        generate = "equal" if row["generate"]["tokens_equal"] else (
            f"differ at step {row['generate']['first_difference']['step']}"
            f"{' (near-tie)' if row['generate']['near_tie'] else ''}")
        speed = f"  decode {row['decode_ratio_to_baseline']:.2f}x" if gpu else ""
        print(f"{name:<8} vs {base:<6} logits {row['logits_rel_error']:.1e}  grads {row['grads_rel_error']:.1e}  "
              f"generate {generate}  fullgraph {row['fullgraph']} (baseline: {row['baseline_fullgraph']}){speed}",
              flush=True)
        write()
        del ours_model, base_model
    if gpu:
        for batch, cache in ((1, 4096), (8, 4096), (1, 32768), (8, 32768), (1, 131072)):
            decode.append(decode_attention(batch, 32, 8, cache, 128, args.rounds))
            d = decode[-1]
            print(f"decode attention ({batch}, 32 heads / 8, cache {cache}, 128): " + ", ".join(
                f"{name} {t * 1e3:.0f} us {d['cache_gb_per_s'][name]:.0f} GB/s" for name, t in d["ms"].items()),
                flush=True)
            write()
    write()


if __name__ == "__main__":
    main()
