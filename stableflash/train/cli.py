"""`stableflash train`: argument parsing over `Trainer`."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from stableflash.train.config import load_config


def add_train_arguments(parser) -> None:
    parser.add_argument("--config", help="TOML file or preset name in configs/ (e.g. tiny-cpu)")
    parser.add_argument("--out", help="run folder (created); required unless --resume")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set optim.lr=3e-4 (repeatable)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue that run in its folder from its checkpoint")
    parser.add_argument("--replay", metavar="RUN_DIR", help="train on exactly the batches recorded in RUN_DIR")
    parser.add_argument("--overwrite", action="store_true", help="--out holds a run: delete its files and start over")


def train_command(args) -> int:
    import torch

    from stableflash.train.loop import train

    if args.resume:
        given = [name for name, value in (("--out", args.out), ("--config", args.config)) if value]
        if given:
            raise ValueError(f"{', '.join(given)}: a resumed run keeps its folder and config (change keys with --set)")
        run_dir = Path(args.resume)
        if not (run_dir / "config.toml").exists():
            raise FileNotFoundError(f"--resume: {run_dir} has no config.toml")
        cfg = load_config(run_dir / "config.toml", args.overrides)
    else:
        if not args.out:
            raise ValueError("--out: a run folder is required (or --resume RUN_DIR)")
        if args.config is None:
            raise ValueError("--config: a TOML file or preset name is required")
        run_dir = Path(args.out)
        cfg = load_config(args.config, args.overrides)
    try:
        summary = train(cfg, run_dir, resume=bool(args.resume), replay=args.replay, overwrite=args.overwrite)
    except RuntimeError as error:  # torch.OutOfMemoryError, or the CPU allocator's: one line, what to change
        if not isinstance(error, torch.OutOfMemoryError) and "can't allocate memory" not in str(error):
            raise
        raise MemoryError(f"out of memory on {cfg.run.device} for a model of {cfg.model.n_layer} layers of width "
                          f"{cfg.model.n_embd} and batches of {cfg.data.batch_size} x {cfg.model.block_size}: make "
                          "it smaller (model.n_layer, model.n_embd, data.batch_size)") from None
    # one write of one line: under torchrun every rank prints its summary into the same pipe
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    if summary["stop_reason"].startswith("signal "):  # stopped and checkpointed: the shell's 128 + the signal
        number = summary["stop_reason"].split()[1]
        return 128 + (int(number) if number.isdigit() else int(signal.SIGTERM))
    return 0
