"""The seed's run at its own scale (docs/seed-scale.md): GPT-2 S on the official recipe (`configs/gpt2s-owt.toml`),
torchrun DDP over every GPU of the host, on the largest natural-English corpus this workplace can build (debian-docs),
in calls of at most 10 minutes that resume from the checkpoint the last call left on the machine's disk.

    python research/seed_scale.py run OUT [--arm paper] [--budget-s 540]        # call again to continue
    python research/seed_scale.py summary OUT OUT/seed-scale.json                # compact JSON of the run (< 16 MiB)
    python research/seed_scale.py measure OUT [--arms paper,fa2,sfa]             # tokens/s per arm on this host
    python research/seed_scale.py project --tokens-per-s 300000 [--efficiency 0.9]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from study_runs import jsonl, trained_steps

ARMS = {
    "paper": ["attention.precision=paper"],
    "fa2": ["attention.precision=fa2"],
    "sfa": ["attention.precision=paper", "attention.stabilize=sfa-official"],
}
TOKENS_PER_STEP = 524_288
"""The seed's tokens per step (32 sequences x 16 accumulation steps x 1024): `data.batch_size=32`, the accumulation
split over the GPUs (16 / N each)."""
TARGET_TOKENS = 3.5e9
"""Where the seed's failure appears: step ~6,600 at 524,288 tokens per step."""
CORPUS = ["data.dataset=debian-docs", "data.data_dir=data"]
CHECKPOINT_STEPS = 200
"""Steps between checkpoints: ~105 M tokens, a few minutes at the throughput the issue expects of 8 GPUs."""
MARGIN_S = 90
"""Seconds of a call's budget kept for starting (compiling) and for the last checkpoint."""


def gpus(requested: int | None) -> int:
    if requested:
        return requested
    import torch
    return max(1, torch.cuda.device_count())


def overrides(nproc: int, arm: str, extra: list[str]) -> list[str]:
    if 16 % nproc:
        raise SystemExit(f"--nproc: {nproc} does not divide the recipe's 16 accumulation steps")
    return [*ARMS[arm], *CORPUS, "data.batch_size=32", f"data.grad_accum={16 // nproc}",
            f"run.checkpoint_interval={CHECKPOINT_STEPS}", "run.progress=false", *extra]


def train_command(folder: Path, config: str, nproc: int, settings: list[str]) -> list[str]:
    """torchrun over `nproc` processes: a new run, or the run in `folder` resumed (its config kept; `settings` are
    only the call's own keys then)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
              "stableflash", "train"]
    if (folder / "checkpoint.pt").exists():
        launch += ["--resume", str(folder)]
    else:
        launch += ["--config", config, "--out", str(folder), "--overwrite"]
    for item in settings:
        launch += ["--set", item]
    return launch


def run(args) -> None:
    """Train (or continue) the run for the call's budget: the trainer stops every rank at one step with a
    checkpoint when its time limit comes (`run.time_limit_s`), so the next call resumes it."""
    nproc = gpus(args.nproc)
    folder = args.out / args.arm
    folder.parent.mkdir(parents=True, exist_ok=True)
    resume = (folder / "checkpoint.pt").exists()
    base = [] if resume else overrides(nproc, args.arm, args.set)
    limit = max(30, args.budget_s - MARGIN_S)
    settings = [*base, f"run.time_limit_s={limit}", f"run.max_steps={args.steps}"]
    with open(args.out / f"{args.arm}.log", "a") as log:
        done = subprocess.run(train_command(folder, args.config, nproc, settings), stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.budget_s + MARGIN_S)
    steps = trained_steps(folder)
    tokens = steps * TOKENS_PER_STEP
    print(f"{args.arm}: exit {done.returncode}, {steps} steps on {nproc} process(es), {tokens / 1e9:.2f} B tokens "
          f"({tokens / TARGET_TOKENS:.1%} of the seed's {TARGET_TOKENS / 1e9:.1f} B)", flush=True)
    if done.returncode != 0:
        raise SystemExit(done.returncode)


def summary(folder: Path) -> dict:
    """The run in brief: per step its loss and gradient norm; per monitored step each layer's and head's W_Q spectral
    norm and attention counters (repeated maxima, by sign, P̄ = 1, biasable rows, largest score); its events; the
    corpus and how many passes over it the run has made."""
    metrics = [m for m in jsonl(folder / "metrics.jsonl") if "loss" in m]
    monitor = [{"step": r["step"], "wq": r.get("spectral", {}).get("q"), "attention": r.get("attention")}
               for r in jsonl(folder / "monitor.jsonl")]
    meta = json.loads((Path("data") / "debian-docs" / "meta.json").read_text()) if (
        Path("data") / "debian-docs" / "meta.json").exists() else {}
    tokens = len(metrics) * TOKENS_PER_STEP
    corpus = meta.get("train_tokens")
    return {"run": folder.name, "steps": [m["step"] for m in metrics], "loss": [m["loss"] for m in metrics],
            "grad_norm": [m["grad_norm"] for m in metrics],
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in metrics) if metrics else None,
            "tokens": tokens, "corpus_tokens": corpus, "passes": tokens / corpus if corpus else None,
            "monitor": monitor, "events": jsonl(folder / "events.jsonl")}


def write_summary(args) -> None:
    doc = summary(args.out / args.arm)
    args.json.write_text(json.dumps(doc))
    size = args.json.stat().st_size
    print(f"wrote {args.json} ({size / 1e6:.2f} MB, {len(doc['steps'])} steps)")
    if size > 16 * 2**20:
        raise SystemExit("the summary is over 16 MiB: the device returns nothing that large")


def measure(args) -> None:
    """Each arm a short run from scratch on this host's GPUs (the recipe's shape, compiled): the median tokens/s
    after its first steps (compiling, autotuning), and the projection to the seed's tokens."""
    nproc = gpus(args.nproc)
    rows = []
    for arm in args.arms.split(","):
        folder = args.out / f"measure-{arm}"
        settings = [*overrides(nproc, arm, args.set), f"run.max_steps={args.steps}", "run.checkpoint_interval=0",
                    "run.eval_interval=0", "monitor.interval=0"]
        started = time.time()
        with open(args.out / f"measure-{arm}.log", "w") as log:
            done = subprocess.run(train_command(folder, args.config, nproc, settings), stdout=log,
                                  stderr=subprocess.STDOUT)
        metrics = [m for m in jsonl(folder / "metrics.jsonl") if "loss" in m]
        rate = statistics.median(m["tokens_per_s"] for m in metrics[args.warmup:]) if len(metrics) > args.warmup else None
        rows.append({"arm": arm, "gpus": nproc, "exit": done.returncode, "steps": len(metrics), "tokens_per_s": rate,
                     "wall_s": time.time() - started})
        print(f"{arm:<8}{nproc:>3} GPU(s){len(metrics):>6} steps  "
              + (f"{rate:>12,.0f} tokens/s" if rate else "failed (see its log)"), flush=True)
    doc = {"tokens_per_step": TOKENS_PER_STEP, "rows": rows,
           "projection": {r["arm"]: projection(r["tokens_per_s"] / r["gpus"], args.efficiency)
                          for r in rows if r["tokens_per_s"]}}
    (args.out / "seed-scale-throughput.json").write_text(json.dumps(doc, indent=2))
    print_projection(doc["projection"], args.efficiency)


def projection(per_gpu_tokens_per_s: float, efficiency: float) -> dict[str, float]:
    """Hours to the seed's tokens on 1, 4 and 8 GPUs, each beyond the first at `efficiency` of linear scaling."""
    return {str(n): TARGET_TOKENS / (per_gpu_tokens_per_s * (1 if n == 1 else n * efficiency)) / 3600
            for n in (1, 4, 8)}


def print_projection(projections: dict, efficiency: float) -> None:
    print(f"hours to {TARGET_TOKENS / 1e9:.1f} B tokens (several GPUs at {efficiency:.0%} of linear scaling):")
    for arm, hours in projections.items():
        print(f"  {arm:<8}" + "  ".join(f"{n} GPU{'s' * (n != '1')}: {h:6.2f}" for n, h in hours.items()))


def project(args) -> None:
    print_projection({"given": projection(args.tokens_per_s / args.gpus, args.efficiency)}, args.efficiency)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--arm", default="paper", choices=list(ARMS))
    r.add_argument("--budget-s", type=float, default=540.0)
    r.add_argument("--steps", type=int, default=math.ceil(TARGET_TOKENS / TOKENS_PER_STEP) + 200)
    m = sub.add_parser("measure")
    m.add_argument("out", type=Path)
    m.add_argument("--arms", default="paper,fa2,sfa")
    m.add_argument("--steps", type=int, default=30)
    m.add_argument("--warmup", type=int, default=10)
    m.add_argument("--efficiency", type=float, default=0.9)
    for p in (r, m):
        p.add_argument("--config", default="gpt2s-owt")
        p.add_argument("--nproc", type=int, default=None, help="processes (default: every GPU)")
        p.add_argument("--set", action="append", default=[], help="extra config overrides")
    s = sub.add_parser("summary")
    s.add_argument("out", type=Path)
    s.add_argument("json", type=Path)
    s.add_argument("--arm", default="paper", choices=list(ARMS))
    p = sub.add_parser("project")
    p.add_argument("--tokens-per-s", type=float, required=True, help="measured on --gpus GPUs")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--efficiency", type=float, default=0.9)
    args = parser.parse_args()
    {"run": run, "summary": write_summary, "measure": measure, "project": project}[args.command](args)


if __name__ == "__main__":
    main()
