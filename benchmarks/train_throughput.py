"""Training throughput of one model shape under several attention settings, in one process.

Prints a table and writes JSON: median tokens/s over the steps after warm-up, and
the ratio to the first setting (the baseline, SDPA by default).

    python benchmarks/train_throughput.py --out results/train-smoke-h200 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from stableflash.train.config import load_config
from stableflash.train.data import ensure_embedded
from stableflash.train.demo import read_jsonl
from stableflash.train.loop import train

SETTINGS = {
    "sdpa": ["attention.backend=sdpa", "attention.precision=fa2"],
    "reference-paper": ["attention.backend=reference", "attention.precision=paper"],
    "reference-fa2": ["attention.backend=reference", "attention.precision=fa2"],
    "reference-paper-sfa": ["attention.backend=reference", "attention.precision=paper", "attention.stabilize=sfa"],
    "triton-fa2": ["attention.backend=triton", "attention.precision=fa2"],
    "triton-fa2-sfa": ["attention.backend=triton", "attention.precision=fa2", "attention.stabilize=sfa"],
    "triton-paper": ["attention.backend=triton", "attention.precision=paper"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--settings", default="sdpa,reference-paper,reference-fa2")
    parser.add_argument("--steps", type=int, default=200, help="steps per setting (reference settings: a quarter)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (run.compile=true)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    data_dir = args.out / "data"
    ensure_embedded(data_dir)
    shape = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024",
             "model.vocab_size=256", "data.batch_size=16", "run.eval_interval=0", "run.checkpoint_interval=0",
             "monitor.interval=0", "run.deterministic=false", "run.device=cuda", "run.progress=false",
             f"data.data_dir={data_dir}", "optim.warmup_steps=100", "optim.decay_steps=5000",
             f"run.compile={str(args.compile).lower()}"]
    rows = []
    for name in args.settings.split(","):
        steps = args.steps if not name.startswith("reference") else max(args.warmup + 10, args.steps // 4)
        cfg = load_config("quick-gpu", [*shape, f"run.max_steps={steps}", *SETTINGS[name], *args.overrides])
        run_dir = args.out / "runs" / name
        started = time.time()
        train(cfg, run_dir)
        metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
        rate = statistics.median(m["tokens_per_s"] for m in metrics[args.warmup:])
        rows.append({"setting": name, "steps": steps, "tokens_per_s": rate, "first_loss": metrics[0]["loss"],
                     "last_loss": metrics[-1]["loss"], "wall_s": time.time() - started})
        torch.cuda.empty_cache()
    for row in rows:
        row["ratio_to_" + rows[0]["setting"]] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    commit = os.environ.get("STABLEFLASH_COMMIT") or (done.stdout.strip() if done.returncode == 0 else None)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "commit": commit, "shape": "GPT-2 S (12L/12H/768), T=1024, 16 sequences/step, bf16 autocast, "
            + ("torch.compile" if args.compile else "eager"),
            "data": "embedded Shakespeare, byte-level (vocab 256)"}
    name = "train-throughput-compiled.json" if args.compile else "train-throughput.json"
    (args.out / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"{'setting':<22}{'steps':>6}{'tokens/s':>12}{'ratio':>8}{'loss first->last':>20}")
    for row in rows:
        ratio = row["ratio_to_" + rows[0]["setting"]]
        print(f"{row['setting']:<22}{row['steps']:>6}{row['tokens_per_s']:>12.0f}{ratio:>8.3f}"
              f"{row['first_loss']:>10.3f} -> {row['last_loss']:.3f}")


if __name__ == "__main__":
    main()
