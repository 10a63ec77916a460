"""The seed's isolation experiments as one resumable runner.

Every experiment trains the same config on the same data (a replayed run's batches) from the
same state (a checkpoint, or the seeded initialisation), changing one thing about the attention
(or the model). Each runs in its own folder and is summarised into one table; an experiment
whose folder already has a summary is skipped, and one that was interrupted resumes from its
own last checkpoint.

    stableflash isolate --config C --replay RUN [--from-checkpoint CKPT] --experiments all --out DIR
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from stableflash.diagnose.pool import run_all
from stableflash.diagnose.record import Record
from stableflash.diagnose.spectral import spectral_history
from stableflash.diagnose.warnings import blowup_step, gradient_explosions, warmup_of
from stableflash.train.checkpoint import save_checkpoint
from stableflash.train.config import load_config
from stableflash.train.records import read_jsonl

# name -> (what it changes, override builder taking (base precision, layer, heads))
EXPERIMENTS = {
    "baseline": ("the config as it is (the analysed attention)", lambda p, layer, heads: []),
    "fp32": ("fp32 attention everywhere", lambda p, layer, heads: ["attention.precision=fp32"]),
    "tiling-off": ("one tile per row and column", lambda p, layer, heads: ["attention.tiling=false"]),
    "only-layer": ("the analysed attention only in layer L, fp32 elsewhere",
                   lambda p, layer, heads: ["attention.precision=fp32", f"attention.layers.{layer}.precision={p}"]),
    "except-layer": ("standard (fp32) attention only in layer L",
                     lambda p, layer, heads: [f"attention.layers.{layer}.precision=fp32"]),
    "delta-dp-p": ("δ = rowsum(dP ∘ P)", lambda p, layer, heads: ["attention.delta=dp_p"]),
    "delta-o-fp32": ("δ from O recomputed in fp32", lambda p, layer, heads: ["attention.delta=do_o_recomputed"]),
    "o-fp32": ("O computed and saved in fp32 in the forward", lambda p, layer, heads: ["attention.o_fp32=true"]),
    "pv-fp32": ("P̄V and its accumulator in fp32", lambda p, layer, heads: ["attention.pv_fp32=true"]),
    "forward-fa2": ("the forward's sites as FA2 rounds them, the backward as it is",
                    lambda p, layer, heads: ["attention.forward_precision=fa2"]),
    "backward-fa2": ("the backward's sites as FA2 rounds them, the forward as it is",
                     lambda p, layer, heads: ["attention.backward_precision=fa2"]),
    "forward-fp32": ("the forward in fp32, the backward as it is",
                     lambda p, layer, heads: ["attention.forward_precision=fp32"]),
    "backward-fp32": ("the backward in fp32, the forward as it is",
                      lambda p, layer, heads: ["attention.backward_precision=fp32"]),
    # S in fp32 needs the saved log-sum-exp in fp32 too: the backward's exp(S - lse) must match its S
    "scores-fp32": ("QKᵀ, the scores, their row max and the saved log-sum-exp in fp32, the rest as it is",
                    lambda p, layer, heads: [f"attention.sites.{s}=fp32" for s in ("qk", "scores", "row_max", "lse")]),
    "lse-fp32": ("the saved log-sum-exp in fp32", lambda p, layer, heads: ["attention.sites.lse=fp32"]),
    "heads-fp32": ("fp32 for layer L's heads with the largest W_Q spectral norm",
                   lambda p, layer, heads: [f"attention.layers.{layer}.heads=[{','.join(map(str, heads))}]",
                                            f"attention.layers.{layer}.head_precision=fp32"]),
    "sfa-official": ("SFA as the paper's code runs it (SFA.official(), β = 2)",
                     lambda p, layer, heads: ["attention.stabilize=sfa-official"]),
    "sfa": ("SFA, our bounded rule, β = 2", lambda p, layer, heads: ["attention.stabilize=sfa"]),
    "sfa-beta1.5": ("SFA (official rule), β = 1.5",
                    lambda p, layer, heads: ["attention.stabilize=sfa-official", "attention.sfa_beta=1.5"]),
    "sfa-beta4": ("SFA (official rule), β = 4",
                  lambda p, layer, heads: ["attention.stabilize=sfa-official", "attention.sfa_beta=4"]),
    "sfa-beta8": ("SFA (official rule), β = 8",
                  lambda p, layer, heads: ["attention.stabilize=sfa-official", "attention.sfa_beta=8"]),
    "clamp": ("ClampPbar: P̄ clamped below 1", lambda p, layer, heads: ["attention.stabilize=clamp"]),
    "qk-norm": ("QK-norm (new parameters: from scratch only)", lambda p, layer, heads: ["model.qk_norm=true"]),
    "qk-clip": ("QK-clip at 100 (Kimi's rescale after each step)", lambda p, layer, heads: ["model.qk_clip=100"]),
}
_CHANGES_PARAMETERS = {"qk-norm"}


def select(spec: str) -> list[str]:
    if spec == "all":
        return list(EXPERIMENTS)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"--experiments: unknown {unknown}; expected 'all' or names from {list(EXPERIMENTS)}")
    return names


def summarise(name: str, run_dir: Path) -> dict:
    """diverged?, step of divergence (after the warm-up, the first non-finite loss or loss that stays >= best
    so far + 1.0), final loss, peaks."""
    losses = [(m["step"], m["loss"]) for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    warmup = warmup_of(run_dir)
    diverged_at = blowup_step(losses, 1.0, after=warmup)
    best = min((loss for step, loss in losses if diverged_at is None or step < diverged_at), default=math.inf)
    stops = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "stop"] \
        if (run_dir / "events.jsonl").exists() else []
    try:
        history = spectral_history(run_dir)
        peak_wq, share = history.peak("q"), max(history.repeated_max_share, default=float("nan"))
    except FileNotFoundError:
        peak_wq = share = float("nan")
    return {"experiment": name, "diverged": diverged_at is not None or bool(stops),
            "divergence_step": diverged_at if diverged_at is not None else (stops[0]["step"] if stops else None),
            "final_loss": losses[-1][1] if losses else float("nan"), "best_loss": best if losses else float("nan"),
            "steps": len(losses), "last_step": losses[-1][0] if losses else None, "peak_wq_spectral_norm": peak_wq,
            "peak_repeated_max_share": share, **gradient_explosions(run_dir, warmup=warmup)}


@dataclass
class IsolationTable(Record):
    config: str
    replay: str | None
    checkpoint: str | None
    layer: int
    heads: list
    rows: list

    def to_markdown(self) -> str:
        lines = ["| experiment | what changes | diverged | step | final loss | steps with gradient norm > 100 | "
                 "peak W_Q σ₁ | repeated-max rows |", "|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            if "skipped" in r:
                what = EXPERIMENTS[r["experiment"]][0]
                lines.append(f"| {r['experiment']} | {what} | - | - | skipped: {r['skipped']} | - | - | - |")
                continue
            step = "-" if r["divergence_step"] is None else r["divergence_step"]
            lines.append(f"| {r['experiment']} | {EXPERIMENTS[r['experiment']][0]} | {'yes' if r['diverged'] else 'no'} | "
                         f"{step} | {r['final_loss']:.3f} | {r.get('grad_spike_steps', '-')} | "
                         f"{r['peak_wq_spectral_norm']:.1f} | {r['peak_repeated_max_share']:.1%} |")
        return "\n".join(lines)


def _largest_wq_heads(cfg, checkpoint: Path | None, layer: int, count: int = 2) -> list[int]:
    """Heads of `layer` whose W_Q block has the largest spectral norm, in the starting state."""
    from stableflash.model.gpt import GPT

    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model, cfg.attention.resolve(cfg.model.n_layer))
    if checkpoint is not None:
        model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=False)["model"])
    attn = model.attentions[layer]
    w_q = attn.c_attn.weight[:attn.n_embd].detach().double().view(attn.n_head, attn.head_dim, attn.n_embd)
    norms = torch.linalg.matrix_norm(w_q, ord=2)
    return sorted(norms.topk(min(count, attn.n_head)).indices.tolist())


def _run_experiment(task: dict) -> dict:
    """Train one experiment in its folder (resuming it, or starting from the given checkpoint) and summarise it."""
    from stableflash.train.loop import train

    run_dir, ckpt = Path(task["run_dir"]), task["checkpoint"]
    resume = (run_dir / "checkpoint.pt").exists()
    if not resume and ckpt is not None:
        # the checkpoint's per-layer attention (kept for resuming after a monitor action) must not
        # override the experiment's: drop it from the copy
        run_dir.mkdir(parents=True, exist_ok=True)
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        state.pop("attention", None)
        save_checkpoint(run_dir, state)
        resume = True
    train(load_config(task["config"], task["overrides"]), run_dir, resume=resume, replay=task["replay"])
    row = summarise(task["name"], run_dir)
    (run_dir / "summary.json").write_text(json.dumps(row, indent=1))
    return row


def run_isolation(config: str | Path, out: str | Path, *, experiments: str = "all", replay: str | Path | None = None,
                  checkpoint: str | Path | None = None, layer: int = 0, overrides: list[str] = (),
                  jobs: int = 1) -> IsolationTable:
    """Run the experiments not yet summarised in `out` (`jobs` at once, each in its own process) and
    write the table (isolation.json, isolation.md) in the order of `experiments`."""
    out = Path(out)
    names = select(experiments)
    base = load_config(config, list(overrides))
    if not 0 <= layer < base.model.n_layer:
        raise ValueError(f"--layer: expected 0..{base.model.n_layer - 1}, got {layer}")
    ckpt = None
    if checkpoint is not None:
        ckpt = Path(checkpoint)
        ckpt = ckpt / "checkpoint.pt" if ckpt.is_dir() else ckpt
        if not ckpt.exists():
            raise FileNotFoundError(f"--from-checkpoint: {ckpt} does not exist")
    if replay is not None and not (Path(replay) / "batches.jsonl").exists():
        raise FileNotFoundError(f"--replay: {replay} has no batches.jsonl")
    heads = _largest_wq_heads(base, ckpt, layer)
    table = IsolationTable(config=str(config), replay=str(replay) if replay else None,
                           checkpoint=str(ckpt) if ckpt else None, layer=layer, heads=heads, rows=[])
    rows, tasks = {}, []
    for name in names:
        summary = out / name / "summary.json"
        if summary.exists():  # finished in an earlier call
            rows[name] = json.loads(summary.read_text())
        elif ckpt is not None and name in _CHANGES_PARAMETERS:
            rows[name] = {"experiment": name, "skipped": "changes the parameter set; run it from scratch"}
        else:
            tasks.append({"name": name, "run_dir": str(out / name), "config": str(config),
                          "checkpoint": str(ckpt) if ckpt else None, "replay": str(replay) if replay else None,
                          "overrides": [*overrides, *EXPERIMENTS[name][1](base.attention.precision, layer, heads)]})

    def write():
        table.rows = [rows[n] for n in names if n in rows]
        table.save(out / "isolation.json")
        (out / "isolation.md").write_text(table.to_markdown() + "\n")

    out.mkdir(parents=True, exist_ok=True)
    for index, row in run_all(_run_experiment, tasks, jobs):
        rows[tasks[index]["name"]] = row
        write()
    write()
    return table
