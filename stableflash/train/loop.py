"""The training loop: BF16 autocast over fp32 master weights, accumulation, clipping, DDP,
atomic checkpoints with bit-exact resume, deterministic replay, metrics and the monitor."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from stableflash.model.gpt import GPT
from stableflash.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from stableflash.train.config import AttentionConfig, TrainConfig
from stableflash.train.data import ReplayLog, TokenData, batch_offsets, ensure_embedded, gather
from stableflash.train.monitor import Monitor
from stableflash.train.optim import build_optimizers, set_lr
from stableflash.train.publish import Publisher, monitor_scalars


class _StopSignal:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step, so it checkpoints and exits."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _distributed() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; initialises the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", "0"))


def _device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


RUN_FILES = ("checkpoint.pt", "config.toml", "run.json", "metrics.jsonl", "monitor.jsonl", "events.jsonl",
             "batches.jsonl")
"""What a run writes into its folder: a folder holding any of them holds a run."""
LOCK = ".lock"


def cpu_threads(cfg: TrainConfig) -> int:
    """The CPU thread count a run uses (see `RunConfig.threads`)."""
    if cfg.run.threads > 0:
        return cfg.run.threads
    return 1 if cfg.run.deterministic else max(1, min(4, (os.cpu_count() or 1) // 2))


def claim_run_folder(run_dir: Path, *, resume: bool, overwrite: bool = False):
    """Lock `run_dir` for this process (released when it exits, a SIGKILL included) and check it fits the call: a
    new run needs a folder without a run in it, or `overwrite`, which removes that run's files (a resume then finds
    its checkpoint, or says it has none). Removes temporary files a killed save left behind. Returns the open lock
    file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = open(run_dir / LOCK, "a+")  # noqa: SIM115 (held open for the run's lifetime)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise BlockingIOError(f"--out: {run_dir} is being written by another training ({holder}); wait for it to "
                              "finish or choose another folder") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()}\n")
    lock.flush()
    present = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not resume and present:
        if not overwrite:
            lock.close()
            raise FileExistsError(f"--out: {run_dir} already holds a run ({', '.join(present)}); continue it with "
                                  f"--resume {run_dir}, start over with --overwrite, or choose another folder")
        for name in present:
            (run_dir / name).unlink()
    for orphan in run_dir.glob("*.tmp[0-9]*"):  # a save killed between write and rename
        orphan.unlink()
    return lock


def _provenance(cfg: TrainConfig, device: torch.device) -> dict:
    source = Path(__file__).resolve().parents[2]  # the checkout the package runs from, whatever the cwd

    def sh(*cmd, cwd=None):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=cwd).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "commit": sh("git", "rev-parse", "HEAD", cwd=source) or os.environ.get("STABLEFLASH_COMMIT"),
            "diff": sh("git", "diff", "--stat", cwd=source),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["nvidia_smi"] = sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv")
    return info


PREVIOUS_CHECKPOINT = "checkpoint-previous.pt"


def _kernels():
    """The fused attention's public seam (`stableflash.attention.triton`), or None where Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    from stableflash.attention import triton as kernels
    return kernels


class Trainer:
    """One run in one folder. `run()` trains from the current step to `cfg.run.max_steps`."""

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, *, resume: bool = False, replay: str | Path | None = None,
                 overwrite: bool = False):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.rank, self.world, local_rank = _distributed()
        self.device = _device(cfg, local_rank)
        self.is_main = self.rank == 0
        self._lock = claim_run_folder(self.run_dir, resume=resume, overwrite=overwrite) if self.is_main else None
        torch.set_num_threads(cpu_threads(cfg))
        if cfg.run.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(cfg.run.seed)
        # the embedded corpus ships with the package: prepared on first use instead of a hint to prepare it
        embedded = cfg.data.dataset == "shakespeare-char"
        self.data = ensure_embedded(cfg.data.data_dir) if embedded else TokenData(cfg.data.data_dir, cfg.data.dataset)
        if self.data.vocab_size > cfg.model.vocab_size:
            raise ValueError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the data's {self.data.vocab_size}")
        # each layer's attention config: what checkpoints keep, and what the monitor's switches replace
        self.layer_configs = [cfg.attention.for_layer(i) for i in range(cfg.model.n_layer)]
        self.model = GPT(cfg.model, [c.layer_attention(None) for c in self.layer_configs]).to(self.device)
        self.ddp = None
        if self.world > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                bucket_cap_mb=cfg.run.ddp_bucket_mb)
        self.train_module = self.ddp if self.ddp is not None else self.model
        if cfg.run.compile:  # the fused attention is a custom op, so the whole model traces as one graph
            self.train_module = torch.compile(self.train_module)
        self.optimizers = build_optimizers(self.model, cfg.optim)
        self.step = 0
        self.replay = ReplayLog(Path(replay) / "batches.jsonl") if replay else None
        if self.replay is not None and not self.replay.recorded:
            raise FileNotFoundError(f"--replay: {replay} has no recorded batches (batches.jsonl)")
        self.monitor = Monitor(cfg.monitor, self.model, self.run_dir, enabled=self.is_main)
        if resume:
            self._load()
        self._pick_attention_tiles()
        self.batch_log = ReplayLog(self.run_dir / "batches.jsonl") if self.is_main else None
        self.publisher = None
        if self.is_main:
            (self.run_dir / "config.toml").write_text(cfg.to_toml())
            if not resume:
                (self.run_dir / "run.json").write_text(json.dumps(_provenance(cfg, self.device), indent=2))
                for name in ("metrics.jsonl", "monitor.jsonl", "events.jsonl"):
                    (self.run_dir / name).write_text("")
            else:
                self._check_threads()
            if cfg.run.tensorboard or cfg.run.wandb:
                self.publisher = Publisher(self.run_dir, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb)

    # -- state ----------------------------------------------------------------------

    def _state(self) -> dict:
        return {"step": self.step, "model": self.model.state_dict(),
                "optimizers": [o.state_dict() for o in self.optimizers], "rng": rng_state(),
                "data_cursor": {"next_step": self.step, "seed": self.cfg.run.seed},
                "attention": [dataclasses.asdict(c) for c in self.layer_configs], "config": self.cfg.to_dict(),
                "tile_picks": kernels.tile_picks_state_dict() if (kernels := _kernels()) is not None else [],
                "monitor": self.monitor.state_dict()}

    def save(self) -> None:
        if self.is_main:
            # the batch of the step a resume (or a diagnosis of this checkpoint) starts with, recorded now: a
            # replay of this run from its own checkpoint finds it
            if self.batch_log is not None and (self.replay is None or self.step in self.replay.recorded):
                self.batch_log.record(self.step, self.batch_offsets(self.step))
            if self.cfg.run.keep_previous_checkpoint:
                self._keep_latest_as(PREVIOUS_CHECKPOINT)  # before a new one replaces it
            save_checkpoint(self.run_dir, self._state())
        if self.world > 1:
            dist.barrier()

    def _keep_latest_as(self, name: str) -> None:
        """The latest checkpoint also under `name`: by a hard link (no copy; a new latest is a new file, so the link
        keeps this one) where the filesystem has them."""
        latest = self.run_dir / "checkpoint.pt"
        if not latest.exists():
            return
        tmp = self.run_dir / (name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(latest, tmp)
        except OSError:
            shutil.copyfile(latest, tmp)
        os.replace(tmp, self.run_dir / name)

    def _load(self) -> None:
        state = load_checkpoint(self.run_dir, map_location=self.device)
        saved = state.get("config", {}).get("model", {})
        changed = sorted(k for k, v in dataclasses.asdict(self.cfg.model).items() if k in saved and saved[k] != v)
        if changed:
            raise ValueError(f"--set: the checkpoint's model has other {', '.join(f'model.{k}' for k in changed)} "
                             f"({', '.join(f'{saved[k]!r}' for k in changed)}); a resume keeps the model's shape, so "
                             "drop those --set or start a new run")
        self.model.load_state_dict(state["model"])
        for opt, s in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(s)
        for layer, saved_attention in enumerate(state.get("attention", [])):
            if isinstance(saved_attention, dict):
                self.layer_configs[layer] = AttentionConfig(**saved_attention)
                self.model.set_layer_attention(layer, self.layer_configs[layer].layer_attention(None))
            else:  # checkpoints of earlier versions pickled the layer's attention itself
                self.model.set_layer_attention(layer, saved_attention)
        set_rng_state(state["rng"])
        if "monitor" in state:
            self.monitor.load_state_dict(state["monitor"])
        kernels = _kernels()
        if state.get("tile_picks") and kernels is not None:
            left_out = kernels.load_tile_picks(state["tile_picks"])
            if left_out:
                message = (f"{left_out} of the checkpoint's tile picks are for kernels this version does not have: "
                           "those launches autotune again, so the continuation may differ in its last bits")
                print(f"stableflash train: warning: {message}", file=sys.stderr)
        self.step = state["step"]
        # drop log lines of steps after the checkpoint: they are recomputed, bit for bit
        for name in ("metrics.jsonl", "monitor.jsonl", "events.jsonl"):
            path = self.run_dir / name
            if path.exists() and self.is_main:
                keep = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", 0) <= self.step]
                path.write_text("".join(line + "\n" for line in keep))

    def _check_threads(self) -> None:
        """Warn when a resume runs on another CPU thread count than the run started with: CPU sums, and so the
        run's last bits, depend on it."""
        path = self.run_dir / "run.json"
        started = json.loads(path.read_text()).get("threads") if path.exists() else None
        now = torch.get_num_threads()
        if started is not None and started != now and self.device.type == "cpu":
            message = (f"resuming with {now} CPU threads where the run started with {started}: the continuation "
                       "is not bit-exact (set run.threads to fix it)")
            print(f"stableflash train: warning: {message}", file=sys.stderr)
            self._log("events.jsonl", {"step": self.step, "kind": "warning", "signal": "threads", "message": message})

    def _pick_attention_tiles(self) -> None:
        """Autotune the fused attention eagerly, once per distinct layer attention, before the first step (a
        compiled one included). The picks are then launched everywhere, kept in checkpoints and restored on resume
        (`_load` runs first, so a resumed run autotunes only launches the checkpoint has no pick for): a resumed
        `fa2` run launches the tiles the interrupted one did, where inductor would autotune again in each process
        and another tile gives other last bits. Under DDP every rank takes rank 0's picks. Called again when the
        monitor switches a layer's attention (launches that have a pick then only run, they are not autotuned).
        Only on a GPU with Triton installed."""
        kernels = _kernels()
        if self.device.type != "cuda" or kernels is None:
            return
        m = self.cfg.model
        shape = (self.cfg.data.batch_size, m.n_head, m.block_size, m.n_embd // m.n_head)
        dtype = torch.bfloat16 if self.cfg.run.dtype == "bf16" else torch.float32
        for a in dict.fromkeys(layer.attention for layer in self.model.attentions if layer.attention.backend
                               in ("auto", "triton")):
            kernels.pick_tiles(shape, precision=a.precision, stabilize=a.stabilize, dtype=dtype, device=self.device)
        if self.world > 1:
            state = [kernels.tile_picks_state_dict() if self.is_main else None]
            dist.broadcast_object_list(state, src=0)
            kernels.load_tile_picks(state[0])

    # -- data -----------------------------------------------------------------------

    @property
    def global_batch(self) -> int:
        return self.world * self.cfg.data.batch_size * self.cfg.data.grad_accum

    def batch_offsets(self, step: int):
        """All of this step's sequence offsets (every rank's), replayed or drawn."""
        if self.replay is not None:
            offsets = self.replay.offsets(step)
            if len(offsets) != self.global_batch:
                raise ValueError(f"--replay: step {step} recorded {len(offsets)} sequences, this run needs "
                                 f"{self.global_batch} (world x data.batch_size x data.grad_accum)")
            return offsets
        return batch_offsets(self.cfg.run.seed, step, self.global_batch, self.cfg.model.block_size,
                             len(self.data.splits["train"]))

    def micro_batches(self, step: int):
        offsets = self.batch_offsets(step)
        if self.batch_log is not None:
            self.batch_log.record(step, offsets)
        per_rank = self.cfg.data.batch_size * self.cfg.data.grad_accum
        mine = offsets[self.rank * per_rank:(self.rank + 1) * per_rank]
        bs = self.cfg.data.batch_size
        for i in range(self.cfg.data.grad_accum):
            x, y = gather(self.data.splits["train"], mine[i * bs:(i + 1) * bs], self.cfg.model.block_size)
            yield x.to(self.device), y.to(self.device)

    def _autocast(self):
        enabled = self.cfg.run.dtype == "bf16"
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=enabled)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = 0.0
        val = self.data.splits["val"]
        for i in range(self.cfg.run.eval_batches):
            offsets = batch_offsets(self.cfg.run.seed, i, self.cfg.data.batch_size, self.cfg.model.block_size,
                                    len(val), split="val")
            x, y = gather(val, offsets, self.cfg.model.block_size)
            with self._autocast():
                _, loss = self.model(x.to(self.device), y.to(self.device))
            total += loss.item()
        self.model.train()
        return total / self.cfg.run.eval_batches

    # -- the loop -------------------------------------------------------------------

    def _log(self, name: str, record: dict) -> None:
        if self.is_main:
            with (self.run_dir / name).open("a") as f:
                f.write(json.dumps(record) + "\n")

    def train_step(self, step: int) -> tuple[float, float, float, tuple]:
        """One optimizer step; returns (loss, grad norm before clipping, lr, last micro-batch)."""
        cfg = self.cfg
        lr = set_lr(self.optimizers, cfg.optim, step)
        module = self.train_module
        total = torch.zeros((), device=self.device)
        last = None
        for i, (x, y) in enumerate(self.micro_batches(step)):
            sync = self.ddp is None or i == cfg.data.grad_accum - 1
            with (contextlib.nullcontext() if sync else self.ddp.no_sync()), self._autocast():
                _, loss = module(x, y)
            (loss / cfg.data.grad_accum).backward()
            total += loss.detach() / cfg.data.grad_accum
            last = (x, y)
        if self.world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf"))
        # a non-finite norm would make clipping multiply by 0 (inf grads -> NaN weights, huge finite ones -> a
        # silent zero step): skip the update instead; run() logs it
        finite = bool(torch.isfinite(grad_norm))
        for opt in self.optimizers:
            if finite:
                opt.step()
            opt.zero_grad(set_to_none=True)
        if cfg.model.qk_clip > 0:
            for attn in self.model.attentions:
                attn.apply_qk_clip(cfg.model.qk_clip)
        return total.item(), grad_norm.item(), lr, last

    def _dump(self, reason: str, batch) -> None:
        dump = self.run_dir / "dump"
        dump.mkdir(exist_ok=True)
        torch.save({"x": batch[0].cpu(), "y": batch[1].cpu()}, dump / "batch.pt")
        last = load_checkpoint(self.run_dir)["step"] if (self.run_dir / "checkpoint.pt").exists() else None
        (dump / "info.json").write_text(json.dumps({"reason": reason, "step": self.step, "last_checkpoint_step": last,
                                                    "monitor_history": "monitor.jsonl"}, indent=2))

    def _intervene(self, event: dict) -> None:
        action = self.cfg.monitor.action
        if action == "none":
            return
        layer = event["layer"]
        current = self.model.attentions[layer].attention
        base = dataclasses.replace(self.cfg.attention.for_layer(layer),
                                   backend="reference" if current.backend in ("sdpa", "math") else current.backend)
        if action in ("sfa", "rollback"):
            switched = dataclasses.replace(base, stabilize="sfa")
        else:
            # fp32 attention as such: the rounding knobs of the replaced policy mean nothing at fp32
            switched = AttentionConfig(backend=base.backend, precision="fp32", tiling=base.tiling, delta=base.delta)
        if action == "rollback" and (self.run_dir / "checkpoint.pt").exists():
            self._load()
        self.layer_configs[layer] = switched
        new = switched.layer_attention(None)
        self.model.set_layer_attention(layer, new)
        self._pick_attention_tiles()  # the new attention's tiles, picked eagerly and kept like the others
        self._log("events.jsonl", {"step": self.step, "kind": "action", "action": action, "layer": layer,
                                   "attention": new.describe()})

    # -- decisions every rank must share: otherwise one rank leaves the loop or swaps its attention
    # while the others wait in the next collective

    def _agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag is true on every rank when it is true on any."""
        if self.world == 1:
            return flags
        shared = torch.tensor([int(f) for f in flags], device=self.device)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        return tuple(bool(f) for f in shared.tolist())

    def _from_main(self, events: list[dict], *, every_rank: bool) -> list[dict]:
        """Rank 0's monitor events on every rank (all ranks call this at the same steps)."""
        if self.world == 1 or not every_rank:
            return events
        box = [events]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def run(self) -> dict:
        cfg = self.cfg
        if self.replay is not None:  # before any step: a replay too short fails now, not after hours
            self.replay.check_covers(self.step, cfg.run.max_steps)
        tokens_per_step = self.global_batch * cfg.model.block_size
        progress = None
        if self.is_main and cfg.run.progress:
            from tqdm.auto import tqdm
            progress = tqdm(total=cfg.run.max_steps, initial=self.step, unit="step", dynamic_ncols=True)
        stop_reason = "max_steps"
        self._started = time.monotonic()
        with _StopSignal() as stop:
            while self.step < cfg.run.max_steps:
                started = time.perf_counter()
                monitored = self.monitor.due(self.step)  # on rank 0 only
                monitor_step = self.monitor.step_due(self.step)
                if monitored:
                    self.monitor.arm(self.model)
                loss, grad_norm, lr, batch = self.train_step(self.step)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - started
                self.step += 1
                record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                          "tokens_per_s": tokens_per_step / elapsed}
                self._log("metrics.jsonl", record)
                if self.publisher is not None:
                    self.publisher.scalars({f"train/{key}": record[key]
                                            for key in ("loss", "lr", "grad_norm", "tokens_per_s")}, self.step)
                if progress is not None:
                    progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                    progress.update(1)
                if not math.isfinite(grad_norm):
                    self._log("events.jsonl", {"step": self.step, "kind": "skipped_step",
                                               "reason": f"gradient norm {grad_norm}"})
                grad_event = self.monitor.check_grad(self.step, grad_norm) if self.is_main else None
                if grad_event is not None:
                    self._log("events.jsonl", grad_event)
                events = []
                if monitored:
                    entry, events = self.monitor.observe(self.step, self.model, loss)
                    self._log("monitor.jsonl", entry)
                    if self.publisher is not None:
                        self.publisher.scalars(monitor_scalars(entry), self.step)
                    for event in events:
                        self._log("events.jsonl", event)
                for event in self._from_main(events, every_rank=monitor_step):
                    self._intervene(event)
                reason = self.monitor.check_loss(self.step, loss, cfg.optim.warmup_steps) if self.is_main else None
                out_of_time = cfg.run.time_limit_s > 0 and time.monotonic() - self._started >= cfg.run.time_limit_s
                loss_stop, signalled = self._agree(reason is not None, stop.received is not None or out_of_time)
                if loss_stop:
                    if reason is not None:
                        self._log("events.jsonl", {"step": self.step, "kind": "stop", "reason": reason})
                        self._dump(reason, batch)
                    stop_reason = reason or "loss stop on rank 0"
                    break
                if cfg.run.eval_interval and self.step % cfg.run.eval_interval == 0:
                    val = self.evaluate()
                    self._log("metrics.jsonl", {"step": self.step, "val_loss": val})
                    if self.publisher is not None:
                        self.publisher.scalars({"val/loss": val}, self.step)
                if cfg.run.checkpoint_interval and self.step % cfg.run.checkpoint_interval == 0:
                    self.save()
                    if cfg.run.keep_interval_checkpoints and self.is_main:
                        self._keep_latest_as(f"checkpoint-{self.step:06d}.pt")
                if signalled:
                    stop_reason = (f"signal {stop.received}" if stop.received else "time limit" if out_of_time
                                   else "signal on another rank")
                    break
        if progress is not None:
            progress.close()
        if not stop_reason.startswith(("loss", "loss spike")):
            self.save()  # a run always checkpoints when it stops
        if self.publisher is not None:
            self.publisher.close()
        return {"step": self.step, "stop_reason": stop_reason, "run_dir": str(self.run_dir), "rank": self.rank,
                "attention": [a.attention.describe() for a in self.model.attentions]}


def train(cfg: TrainConfig, run_dir: str | Path, *, resume: bool = False, replay: str | Path | None = None,
          overwrite: bool = False) -> dict:
    """A run to its end; under torchrun the process group is torn down before returning (left to interpreter exit,
    gloo's threads can be destroyed unjoined and abort a rank). A new run that fails before its first checkpoint
    leaves no run files behind."""
    run_dir = Path(run_dir)
    existed = run_dir.exists()
    try:
        summary = Trainer(cfg, run_dir, resume=resume, replay=replay, overwrite=overwrite).run()
        if dist.is_initialized():
            dist.barrier()  # every rank past its last collective before any tears its group down
        return summary
    except (FileExistsError, BlockingIOError):  # the folder holds another run, or another process holds it
        raise
    except BaseException:
        if not resume and int(os.environ.get("RANK", "0")) == 0:  # rank 0 wrote the files
            _remove_unstarted(run_dir, remove_folder=not existed)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _remove_unstarted(run_dir: Path, *, remove_folder: bool) -> None:
    """After a new run failed before its first checkpoint: the files it wrote (and the folder, where it made it), so
    that no half-made run is left to be mistaken for one. With a checkpoint nothing is removed."""
    if (run_dir / "checkpoint.pt").exists() or not run_dir.is_dir():
        return
    for name in (*RUN_FILES, LOCK):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "tb", ignore_errors=True)
    if remove_folder and not any(run_dir.iterdir()):
        run_dir.rmdir()
