"""DDP on the GPUs of one host, through torchrun and NCCL: scaling, fidelity, resume and failure.

Parts (each writes its entry into OUT/multi-gpu.json as soon as it ends, so a cut run keeps what it did):
- allreduce: NCCL's fp32 all-reduce bandwidth between the GPUs and the transport it chose;
- match:   the same global batch on 1 GPU (gradient accumulation) and on N GPUs (one micro-batch each, the
           1-GPU run's batches replayed): the two loss curves, step by step;
- resume:  N GPUs for S steps straight, against S/2 steps, a checkpoint, and a resume on N GPUs: bit-exact?
- kill:    one rank SIGKILLed mid-run: how the job ends, the last checkpoint, and a resume on N GPUs whose
           losses are compared bit for bit with those the killed run had logged after that checkpoint;
- signal:  SIGTERM to one rank only: every rank stops after the same step, with a checkpoint;
- scaling: tokens/s on 1 and on N GPUs at the same per-GPU batch (weak scaling), for the quick-gpu preset
           and for GPT-2 S's shape (compiled); efficiency = tokens/s on N / (N x tokens/s on 1). As a ceiling
           without communication, N independent 1-GPU runs at once on the same host.

    python benchmarks/multi_gpu.py --out OUT [--gpus 2] [--parts match,resume,kill,signal,scaling]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import commit  # benchmarks/common.py: the script's own folder is on sys.path

from stableflash.train.checkpoint import load_checkpoint
from stableflash.train.data import ensure_embedded
from stableflash.train.records import read_jsonl

QUIET = ["run.progress=false", "run.eval_interval=0"]
GPT2S = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024", "model.vocab_size=50304",
         "model.bias=true", "data.batch_size=16", "attention.precision=fa2", "run.compile=true"]


def command(nproc: int, *args: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "stableflash", "train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "stableflash", "train", *args]


def sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def train(nproc: int, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(nproc))}
    done = subprocess.run(command(nproc, *args), env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])}... on {nproc} GPU(s) failed:\n{done.stderr[-3000:]}")
    return done


def metrics(run: Path) -> list[dict]:
    return [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]


def part_match(args, base) -> dict:
    """Global batch ~32 on 1 GPU (N accumulation steps of 32 // N sequences) and on N GPUs (one each)."""
    n, steps, micro = args.gpus, args.match_steps, 32 // args.gpus
    common = [*base, *sets("run.deterministic=true", f"run.max_steps={steps}", "run.checkpoint_interval=0",
                           f"data.batch_size={micro}")]
    one, many = args.work / "match-1", args.work / f"match-{n}"
    train(1, "--out", str(one), *common, *sets(f"data.grad_accum={n}"))
    train(n, "--out", str(many), *common, "--replay", str(one))
    a, b = metrics(one), metrics(many)
    diffs = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)]
    return {"steps": steps, "global_batch": micro * n, "micro_batch": micro, "loss_1gpu": [m["loss"] for m in a],
            f"loss_{n}gpu": [m["loss"] for m in b], "max_rel_diff": max(diffs), "median_rel_diff": statistics.median(diffs),
            "first_step_rel_diff": diffs[0], "bit_identical_steps": sum(x["loss"] == y["loss"] for x, y in zip(a, b)),
            "bf16_eps": 2.0 ** -8}


def part_resume(args, base) -> dict:
    n, steps = args.gpus, args.resume_steps
    common = [*base, *sets("run.deterministic=true", "run.checkpoint_interval=0")]
    straight, split = args.work / "resume-straight", args.work / "resume-split"
    train(n, "--out", str(straight), *common, *sets(f"run.max_steps={steps}"))
    train(n, "--out", str(split), *common, *sets(f"run.max_steps={steps // 2}"))
    train(n, "--resume", str(split), *sets(f"run.max_steps={steps}"))
    a, b = metrics(straight), metrics(split)
    same = [x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"] for x, y in zip(a, b)]
    return {"steps": steps, "resumed_at": steps // 2, "bit_exact": len(a) == len(b) == steps and all(same),
            "identical_steps": sum(same), "loss_straight": [m["loss"] for m in a], "loss_resumed": [m["loss"] for m in b]}


def _workers(proc: subprocess.Popen) -> list[int]:
    ps = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True)
    return sorted(int(p) for p in ps.stdout.split())


def _start_and_wait(args, run: Path, base, min_steps: int, interval: int) -> subprocess.Popen:
    cmd = command(args.gpus, "--out", str(run), *base,
                  *sets("run.deterministic=true", "run.max_steps=100000", f"run.checkpoint_interval={interval}"))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(args.gpus))}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and len(metrics(run)) >= min_steps:
            return proc
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"{run.name}: fewer than {min_steps} steps within 240 s: {proc.communicate()[1][-2000:]}")


def part_kill(args, base) -> dict:
    run = args.work / "kill"
    proc = _start_and_wait(args, run, base, min_steps=25, interval=10)
    workers = _workers(proc)
    killed_at = time.time()
    os.kill(workers[-1], signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ended_after = time.time() - killed_at
    logged = {m["step"]: m["loss"] for m in metrics(run)}
    state = load_checkpoint(run, map_location="cpu")
    ckpt = state["step"]
    last_logged = max(logged)
    train(args.gpus, "--resume", str(run), *sets(f"run.max_steps={last_logged}"))
    resumed = {m["step"]: m["loss"] for m in metrics(run)}
    redone = [s for s in range(ckpt + 1, last_logged + 1)]
    return {"workers": len(workers), "returncode": proc.returncode, "ended_s_after_kill": round(ended_after, 2),
            "checkpoint_step": ckpt, "steps_logged_before_kill": last_logged,
            "resume_matches_killed_run": all(resumed.get(s) == logged[s] for s in redone), "steps_compared": len(redone),
            "stderr_tail": err[-1500:]}


def part_signal(args, base) -> dict:
    run = args.work / "signal"
    proc = _start_and_wait(args, run, base, min_steps=10, interval=0)
    workers = _workers(proc)
    os.kill(workers[-1], signal.SIGTERM)  # one rank only
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    summary = next((s for s in summaries if s.get("rank") == 0), {})
    ckpt = load_checkpoint(run, map_location="cpu")["step"] if (run / "checkpoint.pt").exists() else None
    return {"returncode": proc.returncode, "summary": summary, "checkpoint_step": ckpt,
            "steps_logged": len(metrics(run)), "stderr_tail": err[-1500:] if proc.returncode else ""}


def _rate(run: Path, warmup: int) -> float:
    return statistics.median(m["tokens_per_s"] for m in metrics(run)[warmup:])


def part_scaling(args, base) -> dict:
    rows = []
    for name, shape in {"quick-gpu": [], "gpt2s-compiled": GPT2S}.items():
        common = [*base, *sets("run.deterministic=false", "run.checkpoint_interval=0", "monitor.interval=0",
                               f"run.max_steps={args.scaling_steps}", *shape)]
        rates = {}
        for nproc in (1, args.gpus):
            run = args.work / f"scaling-{name}-{nproc}"
            started = time.time()
            train(nproc, "--out", str(run), *common)
            rates[nproc] = _rate(run, args.scaling_warmup)
            rows.append({"shape": name, "gpus": nproc, "tokens_per_s": rates[nproc],
                         "tokens_per_s_per_gpu": rates[nproc] / nproc, "wall_s": round(time.time() - started, 1)})
        rows[-1]["efficiency"] = rates[args.gpus] / (args.gpus * rates[1])
        # the ceiling without communication: N independent 1-GPU runs at once, one per GPU (shared host)
        runs = [args.work / f"scaling-{name}-alone-{i}" for i in range(args.gpus)]
        procs = [subprocess.Popen(command(1, "--out", str(run), *common), env={**os.environ, "CUDA_VISIBLE_DEVICES": str(i)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i, run in enumerate(runs)]
        if any(proc.wait(timeout=400) for proc in procs):
            raise RuntimeError(f"{name}: independent runs failed: {procs[0].stderr.read()[-2000:]}")
        together = sum(_rate(run, args.scaling_warmup) for run in runs)
        rows.append({"shape": name, "gpus": args.gpus, "independent_runs": True, "tokens_per_s": together,
                     "tokens_per_s_per_gpu": together / args.gpus, "efficiency": together / (args.gpus * rates[1])})
        print(f"{name}: 1 GPU {rates[1]:.0f} tok/s, {args.gpus} GPUs {rates[args.gpus]:.0f} tok/s, "
              f"efficiency {rows[-2]['efficiency']:.3f} (independent runs at once: {rows[-1]['efficiency']:.3f})",
              flush=True)
    return {"steps": args.scaling_steps, "warmup": args.scaling_warmup, "per_gpu_batch": "preset's (quick-gpu 32x512, "
            "gpt2s 16x1024)", "rows": rows}


def allreduce_worker(out: Path) -> None:
    """Under torchrun: the bus bandwidth of an fp32 all-reduce per size (NCCL's busbw convention)."""
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for mib in (1, 16, 64, 256, 512):
        x = torch.ones(mib * 2**18, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 10
        rows.append({"mib": mib, "ms": seconds * 1e3, "busbw_gb_s": 2 * (world - 1) / world * mib * 2**20 / seconds / 1e9})
    if rank == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def part_allreduce(args, base) -> dict:
    """NCCL all-reduce bandwidth between the GPUs, and the transport NCCL chose (from NCCL_DEBUG=INFO)."""
    result = args.work / "allreduce.json"
    env = {**os.environ, "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(args.gpus))}
    worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
              __file__, "--out", str(args.work), "--allreduce-worker", str(result)]
    done = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    transport = sorted({line.split("NCCL INFO", 1)[1].strip()[:160] for line in log.splitlines()
                        if "NCCL INFO" in line and (" via " in line or "P2P" in line or "SHM" in line)})[:12]
    if done.returncode != 0:
        raise RuntimeError(log[-3000:])
    return {"rows": json.loads(result.read_text()), "nccl_transport_lines": transport}


PARTS = {"allreduce": part_allreduce, "match": part_match, "resume": part_resume, "kill": part_kill,
         "signal": part_signal, "scaling": part_scaling}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/stableflash-multi-gpu"), help="run folders")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--match-steps", type=int, default=100)
    parser.add_argument("--resume-steps", type=int, default=40)
    parser.add_argument("--scaling-steps", type=int, default=60)
    parser.add_argument("--scaling-warmup", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="config override for every run (a CPU smoke test: --set run.device=cpu ...)")
    parser.add_argument("--allreduce-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.allreduce_worker:
        return allreduce_worker(args.allreduce_worker)
    if args.gpus < 2:
        parser.error(f"--gpus: needs at least 2 GPUs, got {args.gpus}")
    args.out.mkdir(parents=True, exist_ok=True)
    data_dir = args.work / "data"
    ensure_embedded(data_dir)
    base = ["--config", "quick-gpu", *sets(*QUIET, f"data.data_dir={data_dir}", *args.overrides)]
    on_gpu = torch.cuda.is_available()
    result = {"meta": {"gpus": [torch.cuda.get_device_name(i) for i in range(args.gpus)] if on_gpu else None,
                       "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None,
                       "date": time.strftime("%Y-%m-%d"), "overrides": args.overrides,
                       "commit": commit(), "world": args.gpus,
                       "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                              "NVSHMEM_DISABLE_NVLS")}}}
    for name in args.parts.split(","):
        started = time.time()
        try:
            result[name] = PARTS[name](args, base)
        except Exception as error:  # one failed part must not hide the others
            result[name] = {"error": f"{type(error).__name__}: {error}"[-3000:]}
        result[name]["wall_s"] = round(time.time() - started, 1)
        print(name, json.dumps({k: v for k, v in result[name].items() if not isinstance(v, list)})[:600], flush=True)
        (args.out / "multi-gpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
