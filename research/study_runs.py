"""What the training studies share: many runs of one config trained at once on one GPU within a time budget and
resumed from their checkpoints in the next call; reading a run's records; commands run side by side to a budget;
the archive of a study's folder.

A run is a folder `OUT/runs/{arm}-s{seed}` made by `stableflash train`; an arm is a list of `--set` overrides.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

DIVERGENCE = 1.0
"""A run diverges at the first step whose loss is non-finite or this much above its best so far."""


def run_arms(out: Path, runs: dict[str, list[str]], *, config: str, steps: int, budget_s: float,
             extra: list[str] = ()) -> None:
    """Start or resume every run (name -> its overrides) not yet at `steps`; stop them all with a checkpoint at the
    budget. A later call may raise `steps`."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for name, overrides in runs.items():
        folder = out / "runs" / name
        if finished(folder, steps):
            continue
        resume = (folder / "checkpoint.pt").exists()
        command = [sys.executable, "-m", "stableflash", "train"]
        command += ["--resume", str(folder)] if resume else ["--config", config, "--out", str(folder)]
        if not resume and folder.exists():  # stopped before it had trained a step: start it over
            command.append("--overwrite")
        for item in (*([] if resume else [*overrides, *extra]), f"run.max_steps={steps}"):
            command += ["--set", item]
        logs.append(open(out / f"{name}.log", "a"))
        procs.append((folder, subprocess.Popen(command, stdout=logs[-1], stderr=subprocess.STDOUT)))
    within_budget([p for _, p in procs], logs, budget_s)
    for folder, p in procs:
        print(f"{folder.name}: exit {p.returncode}, step {trained_steps(folder)}", flush=True)


def within_budget(procs: list[subprocess.Popen], logs: list, budget_s: float) -> None:
    """Wait for the processes for at most `budget_s`, then stop the rest with SIGTERM (a trainer checkpoints on it
    and exits 143), all at once, and wait for them; close their logs."""
    deadline = time.monotonic() + budget_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(2)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait()
    for log in logs:
        log.close()


def run_commands(commands: list[str], logs: Path, budget_s: float) -> None:
    """`stableflash ...` command lines, all at once (one process each), stopped at the budget; each logs to
    `logs/NN-verb.log`. What finished is what a summary reads."""
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for index, command in enumerate(commands):
        words = shlex.split(command)
        files.append(open(logs / f"{index:02d}-{words[1]}.log", "w"))
        files[-1].write(command + "\n")
        files[-1].flush()
        procs.append(subprocess.Popen([sys.executable, "-m", "stableflash", *words[1:]], stdout=files[-1],
                                      stderr=subprocess.STDOUT))
    within_budget(procs, files, budget_s)
    for command, p in zip(commands, procs):
        print(f"exit {p.returncode}: {command}", flush=True)


def finished(folder: Path, steps: int) -> bool:
    """Trained `steps` steps, or stopped by the trainer's NaN/spike detector."""
    if any(e.get("kind") == "stop" for e in jsonl(folder / "events.jsonl")):
        return True
    return trained_steps(folder) >= steps


def trained_steps(folder: Path) -> int:
    return len([m for m in jsonl(folder / "metrics.jsonl") if "loss" in m])


def jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_divergence(losses: list[float]) -> int | None:
    """The index of the first loss that is non-finite or DIVERGENCE above the best before it."""
    best = math.inf
    for step, loss in enumerate(losses):
        if not math.isfinite(loss) or loss >= best + DIVERGENCE:
            return step
        best = min(best, loss)
    return None


def summarise_run(folder: Path) -> dict:
    """A run's losses, gradient norms, monitor records (W_Q spectral norms per head, attention statistics), its
    fastest-growing W_Q head, and its first diverging step (counted from 1, as the metrics' steps)."""
    records = [m for m in jsonl(folder / "metrics.jsonl") if "loss" in m]
    losses = [m["loss"] for m in records]
    monitor = [r for r in jsonl(folder / "monitor.jsonl") if "spectral" in r]
    wq = [[[float(x) for x in heads] for heads in r["spectral"]["q"]] for r in monitor]  # step, layer, head
    growth = None
    if len(wq) >= 2:
        rise = [[wq[-1][layer][h] / wq[0][layer][h] for h in range(len(wq[0][layer]))] for layer in range(len(wq[0]))]
        layer, head = max(((li, hi) for li, heads in enumerate(rise) for hi in range(len(heads))),
                          key=lambda lh: rise[lh[0]][lh[1]])
        growth = {"layer": layer, "head": head, "ratio": rise[layer][head]}
    attention = [r.get("attention") for r in monitor if r.get("attention")]
    # the rule's diverging step, or the trainer's own loss stop (non-finite or spiking loss) where the rule saw none
    rule = first_divergence(losses)
    stops = [e["step"] for e in jsonl(folder / "events.jsonl") if e.get("kind") == "stop"]
    diverged = [s for s in (None if rule is None else rule + 1, *stops[:1]) if s is not None]
    return {"steps": len(losses), "best_loss": min((x for x in losses if math.isfinite(x)), default=math.nan),
            "final_loss": losses[-1] if losses else math.nan, "first_divergence": min(diverged, default=None),
            "losses": losses, "grad_norms": [m.get("grad_norm", math.nan) for m in records],
            "monitor_steps": [r["step"] for r in monitor],
            "wq_spectral": wq, "wq_growth": growth, "attention": attention}


def collect(out: Path) -> dict[str, list[dict]]:
    """Every run of OUT/runs summarised, by arm (the folder's name before `-s{seed}`)."""
    arms: dict[str, list[dict]] = {}
    for folder in sorted((out / "runs").iterdir()):
        arm = folder.name.rsplit("-s", 1)[0]
        arms.setdefault(arm, []).append(summarise_run(folder) | {"run": folder.name})
    return arms


def growth_layer(run: dict) -> int:
    """The layer of the run's fastest-growing W_Q head (0 without spectral records)."""
    return run["wq_growth"]["layer"] if run["wq_growth"] else 0


def checkpoint_before(run: Path, step: int) -> Path | None:
    """The run's last kept interval checkpoint (`run.keep_interval_checkpoints`) before its diverging `step`: one of
    at most `step - 1` trained steps."""
    kept = {int(p.stem.split("-")[1]): p for p in run.glob("checkpoint-[0-9]*.pt")}
    steps = [trained for trained in kept if trained < step]
    return kept[max(steps)] if steps else None


def pack(out: Path, archive: Path) -> None:
    """A study's folder as one archive: its summaries, figures, diagnoses, logs and each run's records (no
    checkpoints, no compile cache)."""
    import tarfile

    def small(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        return None if info.name.endswith(".pt") or "cache" in parts[:2] else info

    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=small)
    print(f"wrote {archive} ({archive.stat().st_size / 1e6:.1f} MB)")


def study_parser(description: str, *, finish_budget_s: float):
    """The studies' command line: `run` (each study adds its own options to the returned run parser), `finish OUT`,
    `summarise OUT` (its parser returned too) and `pack OUT ARCHIVE`. Returns (parser, run, summarise)."""
    parser = argparse.ArgumentParser(description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--config", default="study-6l")
    run.add_argument("--budget-s", type=float, default=540.0)
    run.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    finish = sub.add_parser("finish")
    finish.add_argument("out", type=Path)
    finish.add_argument("--budget-s", type=float, default=finish_budget_s)
    summarise = sub.add_parser("summarise")
    summarise.add_argument("out", type=Path)
    pack_parser = sub.add_parser("pack")
    pack_parser.add_argument("out", type=Path)
    pack_parser.add_argument("archive", type=Path)
    return parser, run, summarise


def dispatch(args, **commands) -> None:
    """Run the parsed command: `pack` here, the others by name from `commands`."""
    if args.command == "pack":
        pack(args.out, args.archive)
    else:
        commands[args.command](args)
