"""A tiny Llama (grouped-query attention) from `transformers`, trained with stableflash's SFA attention and the
monitor watching it, on the embedded Shakespeare corpus (bytes). Runs on a 2-core CPU in about a minute:

    python examples/hf_llama_sfa.py --steps 200 --out runs/hf-llama
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import stableflash
from stableflash.integrations.transformers import register
from stableflash.train.data import ensure_embedded


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/hf-llama"))
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    register()
    data = ensure_embedded(args.out / "data").splits["train"]
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="stableflash_sfa")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1)
    started = time.time()
    with stableflash.watch(model, log_dir=args.out, interval=10, action="fp32") as watcher:
        for step in range(args.steps):
            starts = torch.randint(0, len(data) - 65, (8,), generator=gen)
            ids = torch.stack([torch.from_numpy(data[s:s + 64].astype("int64")) for s in starts.tolist()])
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for event in watcher.step(loss.item(), grad_norm):
                print(f"step {step}: {event['kind']} {event.get('signal', event.get('action'))} "
                      f"layer {event.get('layer', '-')} head {event.get('head', '-')}")
            if step % 50 == 0 or step == args.steps - 1:
                print(f"step {step}: loss {loss.item():.3f} ({time.time() - started:.0f} s)")
    print(f"wrote {args.out / 'monitor.jsonl'} and {args.out / 'events.jsonl'}")
    return watcher.events


if __name__ == "__main__":
    main()
