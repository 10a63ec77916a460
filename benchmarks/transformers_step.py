"""A `transformers` Llama's compiled training step: `"sdpa"` against `"stableflash"` and `"stableflash_sfa"`.

GQA (12 query heads, 4 key/value heads of 64), bf16 autocast, AdamW, `torch.compile` of the model; the same
initialisation and batches for every implementation. Per implementation: dynamo's graph-break count
(`torch._dynamo.explain`), then interleaved rounds of timed steps; the table gives the median step time and its ratio
to `"sdpa"` in the same round. Writes JSON:

    python benchmarks/transformers_step.py --out results/transformers-h200/transformers-step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import run_meta  # benchmarks/common.py: the script's own folder is on sys.path
from transformers import AutoModelForCausalLM, LlamaConfig

from stableflash.integrations.transformers import register

IMPLEMENTATIONS = ("sdpa", "stableflash", "stableflash_sfa")


def build(impl: str, args):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width,
                         num_hidden_layers=args.layers, num_attention_heads=args.width // 64,
                         num_key_value_heads=args.width // 64 // args.group, max_position_embeddings=args.seq_len)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--group", type=int, default=3, help="query heads per key/value head")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    register()
    generator = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), device="cuda", generator=generator)
    runs = {}
    for impl in IMPLEMENTATIONS:
        model, opt = build(impl, args)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            breaks = torch._dynamo.explain(model)(input_ids=ids, labels=ids).graph_break_count
        torch._dynamo.reset()
        compiled = torch.compile(model)

        def step(compiled=compiled, opt=opt):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for _ in range(3):  # compile, autotune
            first_loss = step().item()
        runs[impl] = {"step": step, "graph_breaks": breaks, "first_loss": first_loss, "ms": []}
    for run in runs.values():  # each later model's `_dynamo.reset()` dropped the earlier ones' compiled code
        for _ in range(3):
            run["step"]()
    for _ in range(args.rounds):
        for run in runs.values():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                run["step"]()
            torch.cuda.synchronize()
            run["ms"].append((time.perf_counter() - start) / args.steps * 1e3)
    rows = []
    print(f"{'implementation':<18}{'graph breaks':>13}{'ms/step':>10}{'vs sdpa':>9}   (median of rounds)")
    for impl, run in runs.items():
        ratios = [ms / base for ms, base in zip(run["ms"], runs["sdpa"]["ms"])]
        row = {"impl": impl, "graph_breaks": run["graph_breaks"], "first_loss": run["first_loss"],
               "ms_per_step": run["ms"], "ratio_to_sdpa": ratios}
        rows.append(row)
        print(f"{impl:<18}{run['graph_breaks']:>13}{statistics.median(run['ms']):>10.2f}"
              f"{statistics.median(ratios):>8.3f}x")
    meta = run_meta() | {k: v for k, v in vars(args).items() if k != "out"} | {
        "timing": "wall time of `steps` compiled steps (forward, backward, AdamW) per round, synchronised"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
