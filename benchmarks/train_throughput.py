"""Training throughput of one model shape under several attention settings, in one process.

Prints a table and writes JSON: median tokens/s over the steps after warm-up, the ratio to
the first setting (the baseline, SDPA by default), and, for interleaved rounds (a list that
repeats its first setting), the ratio to the same round's baseline. With `--profile`, each
setting instead runs `--warmup` steps and then profiles `--steps` steps with torch.profiler:
wall time per step, device time of the kernels per step (and the share of the wall time
the GPU was busy), the attention kernels' share, and the top kernels.

    python benchmarks/train_throughput.py --out results/train-smoke-h200 --steps 200
    python benchmarks/train_throughput.py --out OUT --compile --profile --steps 10 --settings sdpa,triton-fa2
    python benchmarks/train_throughput.py --summary results/train-smoke-h200/train-throughput-compiled-756335f.json

A triton setting with the suffix `-opaque` (e.g. `triton-fa2-opaque`) runs the kernels as opaque custom ops under
torch.compile instead of letting inductor launch them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import run_meta  # benchmarks/common.py: the script's own folder is on sys.path

from stableflash.train.config import load_config
from stableflash.train.data import ensure_embedded
from stableflash.train.loop import Trainer, train
from stableflash.train.records import read_jsonl

SETTINGS = {
    "sdpa": ["attention.backend=sdpa", "attention.precision=fa2"],
    "reference-paper": ["attention.backend=reference", "attention.precision=paper"],
    "reference-fa2": ["attention.backend=reference", "attention.precision=fa2"],
    "reference-paper-sfa": ["attention.backend=reference", "attention.precision=paper", "attention.stabilize=sfa"],
    "triton-fa2": ["attention.backend=triton", "attention.precision=fa2"],
    "triton-fa2-sfa": ["attention.backend=triton", "attention.precision=fa2", "attention.stabilize=sfa"],
    "triton-paper": ["attention.backend=triton", "attention.precision=paper"],
}
def _apply_setting(name: str) -> list[str]:
    """The setting's config overrides."""
    return SETTINGS[name]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for the runs and the JSON (required unless --summary)")
    parser.add_argument("--summary", type=Path, help="reprint the table of a written JSON, without a GPU")
    parser.add_argument("--settings", default="sdpa,reference-paper,reference-fa2")
    parser.add_argument("--steps", type=int, default=200, help="steps per setting (reference settings: a quarter)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (run.compile=true)")
    parser.add_argument("--profile", action="store_true", help="profile --steps steps after --warmup (no training run)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    if args.summary:
        doc = json.loads(args.summary.read_text())
        return print_table(doc | {"rows": add_ratios(doc["rows"])})
    if args.out is None:
        parser.error("--out: a folder for the runs and the JSON is required (or --summary JSON to reprint one)")
    data_dir = args.out / "data"
    ensure_embedded(data_dir)
    shape = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024",
             "model.vocab_size=256", "data.batch_size=16", "run.eval_interval=0", "run.checkpoint_interval=0",
             "monitor.interval=0", "run.deterministic=false", "run.device=cuda", "run.progress=false",
             f"data.data_dir={data_dir}", "optim.warmup_steps=100", "optim.decay_steps=5000",
             f"run.compile={str(args.compile).lower()}"]
    if args.profile:
        return profile_settings(args, shape)
    rows = []
    for index, name in enumerate(args.settings.split(",")):  # a setting may repeat (interleaved repeats)
        steps = args.steps if not name.startswith("reference") else max(args.warmup + 10, args.steps // 4)
        cfg = load_config("quick-gpu", [*shape, f"run.max_steps={steps}", *_apply_setting(name), *args.overrides])
        run_dir = args.out / "runs" / f"{index}-{name}"
        started = time.time()
        try:
            train(cfg, run_dir)
        except Exception as error:  # one setting's failure is its row's, not the benchmark's
            rows.append({"setting": name, "steps": steps, "error": f"{type(error).__name__}: {error}"[:300]})
            torch.cuda.empty_cache()
            continue
        metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
        rate = statistics.median(m["tokens_per_s"] for m in metrics[args.warmup:])
        rows.append({"setting": name, "steps": steps, "tokens_per_s": rate, "first_loss": metrics[0]["loss"],
                     "last_loss": metrics[-1]["loss"], "wall_s": time.time() - started})
        torch.cuda.empty_cache()
    add_ratios(rows)
    doc = {"meta": _meta(args), "rows": rows, "rounds": round_summary(rows)}
    name = "train-throughput-compiled.json" if args.compile else "train-throughput.json"
    (args.out / name).write_text(json.dumps(doc, indent=2))
    print_table(doc)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's ratio to the first row (the baseline) and, for interleaved rounds (a setting list that repeats
    its first setting), to its own round's baseline, the latest run of the first setting before it: the machine's
    speed drifts between rounds. Fills JSON written before the per-round ratio too."""
    baseline = rows[0]["setting"]
    first = next((row["tokens_per_s"] for row in rows if row["setting"] == baseline and "error" not in row), None)
    round_baseline = None
    for row in rows:
        if row["setting"] == baseline:
            round_baseline = row.get("tokens_per_s")
        if "error" in row:
            continue
        row["ratio_to_" + baseline] = row["tokens_per_s"] / first if first else None
        row[f"ratio_to_round_{baseline}"] = row["tokens_per_s"] / round_baseline if round_baseline else None
    return rows


def round_summary(rows: list[dict]) -> dict:
    """Per setting other than the baseline: how many rounds, and the median, least and largest ratio to the
    same round's baseline (the figure to judge interleaved rounds by)."""
    baseline = rows[0]["setting"]
    ratios: dict[str, list[float]] = {}
    for row in rows:
        if row["setting"] != baseline and row.get(f"ratio_to_round_{baseline}") is not None:
            ratios.setdefault(row["setting"], []).append(row[f"ratio_to_round_{baseline}"])
    return {name: {"rounds": len(r), "median": statistics.median(r), "min": min(r), "max": max(r)}
            for name, r in ratios.items()}


def print_table(doc: dict):
    rows = doc["rows"]
    baseline = rows[0]["setting"]
    print(f"{'setting':<22}{'steps':>6}{'tokens/s':>12}{'ratio':>8}{'in round':>10}{'loss first->last':>20}")
    def ratio(value):
        return f"{value:.3f}" if value is not None else "-"

    for row in rows:
        if "error" in row:
            print(f"{row['setting']:<22}{row['steps']:>6}  failed: {row['error']}")
            continue
        print(f"{row['setting']:<22}{row['steps']:>6}{row['tokens_per_s']:>12.0f}{ratio(row['ratio_to_' + baseline]):>8}"
              f"{ratio(row[f'ratio_to_round_{baseline}']):>10}{row['first_loss']:>10.3f} -> {row['last_loss']:.3f}")
    print(f"\nagainst the same round's {baseline}:")
    for name, s in round_summary(rows).items():
        rounds = f"{s['rounds']} round" + "s" * (s["rounds"] != 1)
        print(f"{name:<22}{rounds:>10}  median {s['median']:.3f}  least {s['min']:.3f}  largest {s['max']:.3f}")


def _meta(args) -> dict:
    return run_meta() | {"shape": "GPT-2 S (12L/12H/768), T=1024, 16 sequences/step, bf16 autocast, "
                         + ("torch.compile" if args.compile else "eager"), "overrides": args.overrides,
                         "data": "embedded Shakespeare, byte-level (vocab 256)"}


def profile_steps(trainer: Trainer, warmup: int, steps: int) -> dict:
    """Wall and kernel time per step of `trainer.train_step`, after `warmup` steps (compiles, autotunes)."""
    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for step in range(warmup):
        trainer.train_step(step)
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        for step in range(warmup, warmup + steps):
            trainer.train_step(step)
        sync()
        wall_ms = (time.perf_counter() - started) * 1e3 / steps
    averages = prof.key_averages()
    kernels = {}
    for event in averages:
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            kernels[event.key] = event.self_device_time_total / 1e3 / steps
    device_ms = sum(kernels.values())
    attention = sum(ms for key, ms in kernels.items() if "_attn_" in key or "flash" in key.lower() or "fmha" in key)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {"wall_ms_per_step": wall_ms, "kernel_ms_per_step": device_ms,
            "gpu_busy_share": device_ms / wall_ms if cuda else None, "attention_kernel_ms_per_step": attention,
            "kernels_per_step": sum(e.count for e in averages if e.device_type == torch.autograd.DeviceType.CUDA)
            / steps, "top_kernels_ms_per_step": [{"kernel": k[:120], "ms": ms} for k, ms in top]}


def profile_settings(args, shape):
    rows = []
    for name in args.settings.split(","):
        cfg = load_config("quick-gpu", [*shape, *_apply_setting(name), *args.overrides])
        trainer = Trainer(cfg, args.out / "runs" / name)
        rows.append({"setting": name, **profile_steps(trainer, args.warmup, args.steps)})
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    name = "train-profile-compiled.json" if args.compile else "train-profile.json"
    (args.out / name).write_text(json.dumps({"meta": _meta(args), "rows": rows}, indent=2))
    print(f"{'setting':<22}{'wall ms':>9}{'kernel ms':>11}{'busy':>7}{'attn ms':>9}{'kernels':>9}")
    for row in rows:
        busy = "-" if row["gpu_busy_share"] is None else f"{row['gpu_busy_share']:.2f}"
        print(f"{row['setting']:<22}{row['wall_ms_per_step']:>9.2f}{row['kernel_ms_per_step']:>11.2f}{busy:>7}"
              f"{row['attention_kernel_ms_per_step']:>9.2f}{row['kernels_per_step']:>9.0f}")
    for row in rows:
        top = row["top_kernels_ms_per_step"][:8]
        print(f"\n{row['setting']}: " + "; ".join(f"{k['kernel'][:50]} {k['ms']:.2f}" for k in top))


if __name__ == "__main__":
    main()
