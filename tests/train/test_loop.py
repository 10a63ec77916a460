"""The trainer, run for real: it learns, resumes bit-exactly, replays, survives kills, runs under torchrun."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stableflash.cli import main
from stableflash.train.checkpoint import load_checkpoint, save_checkpoint
from stableflash.train.loop import train
from stableflash.train.records import read_jsonl

_STDERR_TAIL = 8000  # torchrun prints its summary last: the failing rank's own message comes before it


def losses(run: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]


def test_train_cli_40_steps_finite_and_falling(tmp_path, data_dir):
    run = tmp_path / "run"
    assert main(["train", "--config", "configs/tiny-cpu.toml", "--out", str(run), "--set", "max_steps=40",
                 "--set", f"data.data_dir={data_dir}", "--set", "run.progress=false"]) == 0
    values = losses(run)
    assert len(values) == 40 and all(math.isfinite(v) for v in values)
    assert sum(values[-5:]) / 5 < values[0] - 1.0
    metrics = read_jsonl(run / "metrics.jsonl")
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(metrics[0])
    assert any("val_loss" in m for m in metrics)
    assert (run / "config.toml").exists() and (run / "checkpoint.pt").exists() and (run / "run.json").exists()
    assert load_checkpoint(run)["step"] == 40


def test_resume_is_bit_exact(tmp_path, tiny):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(tiny("run.max_steps=20", "run.checkpoint_interval=0"), straight)
    train(tiny("run.max_steps=10", "run.checkpoint_interval=0"), split)
    assert main(["train", "--resume", str(split), "--set", "run.max_steps=20"]) == 0
    a, b = losses(straight), losses(split)
    assert len(b) == 20 and a[10:20] == b[10:20]
    assert [m["step"] for m in read_jsonl(split / "metrics.jsonl") if "loss" in m] == list(range(1, 21))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_resume_on_the_gpu_is_bit_exact(tmp_path, tiny):
    # the checkpoint loads onto the GPU (RNG states included, which must go back to the CPU)
    gpu = ("run.device=cuda", "run.checkpoint_interval=0", "attention.backend=triton", "attention.precision=paper")
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(tiny("run.max_steps=12", *gpu), straight)
    train(tiny("run.max_steps=6", *gpu), split)
    assert main(["train", "--resume", str(split), "--set", "run.max_steps=12"]) == 0
    a, b = losses(straight), losses(split)
    assert len(b) == 12 and a == b


def test_checkpoints_keep_the_attention_tile_picks(tmp_path, tiny):
    """The fused attention's autotuner picks go into every checkpoint and are pinned again on resume (on a GPU the
    trainer makes them before the first step; here one is planted)."""
    pytest.importorskip("triton")
    from stableflash.attention.triton.tuning import TILE_PICKS, TilePicks

    key = TilePicks.key("attn_fwd", "pointers", 64, torch.bfloat16, {"CAUSAL": True})
    saved = TILE_PICKS.state_dict()
    try:
        TILE_PICKS.clear()
        TILE_PICKS.load_state_dict([{"key": list(key), "kwargs": {"BLOCK_M": 64, "BLOCK_N": 32}, "num_warps": 4,
                                     "num_stages": 2}])
        train(tiny("run.max_steps=2", "run.checkpoint_interval=0"), tmp_path / "run")
        assert load_checkpoint(tmp_path / "run")["tile_picks"] == TILE_PICKS.state_dict()
        TILE_PICKS.clear()
        assert main(["train", "--resume", str(tmp_path / "run"), "--set", "run.max_steps=3"]) == 0
        assert TILE_PICKS.get(key).kwargs == {"BLOCK_M": 64, "BLOCK_N": 32}
    finally:
        TILE_PICKS.clear()
        TILE_PICKS.load_state_dict(saved)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fa2_resume_on_the_gpu_launches_the_checkpointed_tiles(tmp_path, tiny):
    """With native numerics the kernels are autotuned; a resumed run must launch the interrupted run's tiles, not
    its own picks. The resume runs as a fresh process would (no picks, no cached launches or autotuner results) and
    with every picked tile taken out of the autotuner's candidates: only the checkpoint's picks can then give the
    same bits. Compiled, so the picks must also reach inductor."""
    from stableflash.attention.triton import tuning
    from stableflash.attention.triton.tuning import TILE_PICKS

    gpu = ("run.device=cuda", "run.checkpoint_interval=0", "attention.backend=triton", "attention.precision=fa2",
           "run.compile=true", "model.n_embd=128", "model.n_head=2", "model.block_size=256")  # tiles that differ
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(tiny("run.max_steps=8", *gpu), straight)
    train(tiny("run.max_steps=4", *gpu), split)
    picked = {(tuple(sorted(p["kwargs"].items())), p["num_warps"], p["num_stages"])
              for p in load_checkpoint(split)["tile_picks"]}
    assert picked
    tuners = [t for tunable in (tuning.NATIVE_FWD, tuning.NATIVE_DQ, tuning.NATIVE_DKDV)
              for t in (tunable.pointers, tunable.either)]
    saved = [t.configs for t in tuners]
    try:
        TILE_PICKS.clear()
        torch._dynamo.reset()
        for t in tuners:
            t.cache.clear()
            others = [c for c in t.configs
                      if (tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) not in picked]
            t.configs = others or t.configs
        assert main(["train", "--resume", str(split), "--set", "run.max_steps=8"]) == 0
    finally:
        for t, configs in zip(tuners, saved):
            t.configs = configs
    assert losses(straight) == losses(split)


def test_two_runs_are_bit_identical_and_schedule_ignores_max_steps(tmp_path, tiny):
    train(tiny("run.max_steps=8"), tmp_path / "a")
    train(tiny("run.max_steps=12"), tmp_path / "b")
    assert losses(tmp_path / "a") == losses(tmp_path / "b")[:8]
    lrs = lambda run: [m["lr"] for m in read_jsonl(run / "metrics.jsonl") if "lr" in m]  # noqa: E731
    assert lrs(tmp_path / "a") == lrs(tmp_path / "b")[:8]


def test_replay_sees_the_same_batches(tmp_path, tiny):
    train(tiny("run.max_steps=6"), tmp_path / "a")
    train(tiny("run.max_steps=6", "run.seed=99", "attention.stabilize=sfa"), tmp_path / "b", replay=tmp_path / "a")
    assert (tmp_path / "a" / "batches.jsonl").read_text() == (tmp_path / "b" / "batches.jsonl").read_text()
    train(tiny("run.max_steps=6", "run.seed=99"), tmp_path / "c")
    assert (tmp_path / "c" / "batches.jsonl").read_text() != (tmp_path / "a" / "batches.jsonl").read_text()
    # a run records the batch of the step its last checkpoint resumes at (6), so 7 is the first one missing;
    # the check comes before any step is trained
    with pytest.raises(ValueError, match="missing from step 7"):
        train(tiny("run.max_steps=9"), tmp_path / "d", replay=tmp_path / "a")
    assert not (tmp_path / "d").exists()  # nothing trained: no run left behind


def test_the_embedded_corpus_is_prepared_on_first_use_and_other_data_named(tmp_path, tiny):
    train(tiny(f"data.data_dir={tmp_path}", "run.max_steps=2"), tmp_path / "run")
    assert (tmp_path / "shakespeare-char" / "train.bin").exists()
    with pytest.raises(FileNotFoundError, match="stableflash prepare --dataset openwebtext"):
        train(tiny(f"data.data_dir={tmp_path}", "data.dataset=openwebtext", "model.vocab_size=50304"), tmp_path / "b")


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_both_optimizers_train(tmp_path, tiny, optimizer):
    train(tiny("run.max_steps=30", f"optim.name={optimizer}"), tmp_path / optimizer)
    values = losses(tmp_path / optimizer)
    assert sum(values[-5:]) / 5 < values[0] - 1.0


_KILL_WRITER = """
import sys, torch
from pathlib import Path
from stableflash.train.checkpoint import save_checkpoint
run = Path(sys.argv[1])
print("ready", flush=True)
i = 0
while True:
    i += 1
    save_checkpoint(run, {"step": i, "blob": torch.randn(4_000_000)})
"""


def test_sigkill_during_checkpoint_write_leaves_a_loadable_checkpoint(tmp_path):
    save_checkpoint(tmp_path, {"step": 0, "blob": torch.zeros(10)})
    for delay in (0.3, 0.7, 1.1):
        proc = subprocess.Popen([sys.executable, "-c", _KILL_WRITER, str(tmp_path)], stdout=subprocess.PIPE)
        proc.stdout.readline()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = load_checkpoint(tmp_path)
        assert isinstance(state["step"], int)
    leftovers = list(tmp_path.glob("*.tmp*"))
    assert all(p.name.startswith("checkpoint.pt.tmp") for p in leftovers)


def test_sigterm_checkpoints_and_exits(tmp_path, data_dir):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "stableflash", "train", "--config", "configs/tiny-cpu.toml", "--out", str(run),
           "--set", "run.max_steps=100000", "--set", f"data.data_dir={data_dir}", "--set", "run.progress=false",
           "--set", "run.checkpoint_interval=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and (not (run / "metrics.jsonl").exists() or len(losses(run)) < 5):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM  # stopped by a signal, checkpointed: the shell's convention
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stop_reason"] == f"signal {int(signal.SIGTERM)}"
    assert load_checkpoint(run)["step"] == summary["step"] >= 5


def test_torchrun_two_processes_match_one(tmp_path, data_dir):
    common = ["--config", "configs/tiny-cpu.toml", "--set", "run.max_steps=5", "--set", f"data.data_dir={data_dir}",
              "--set", "run.progress=false", "--set", "attention.backend=sdpa", "--set", "attention.precision=fa2",
              "--set", "run.dtype=fp32", "--set", "monitor.interval=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "stableflash", "train", "--out", str(tmp_path / "two"), *common,
                          "--set", "data.batch_size=4"], env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-_STDERR_TAIL:]
    assert main(["train", "--out", str(tmp_path / "one"), *common, "--set", "data.batch_size=4",
                 "--set", "data.grad_accum=2"]) == 0
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 5
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4



def test_torchrun_ranks_tear_down_their_process_group(tmp_path, data_dir):
    """`train` destroys the process group before it returns: left to interpreter exit, gloo's threads were destroyed
    unjoined and a rank could abort after a finished run (it did in CI once, and in 11 of 25 bare two-process runs
    on a loaded 2-core machine)."""
    script = tmp_path / "run.py"
    script.write_text("import sys\nimport torch.distributed as dist\nfrom stableflash.cli import main\n"
                      "code = main(sys.argv[1:])\nassert not dist.is_initialized(), 'process group left up'\n"
                      "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), "train", "--out", str(tmp_path / "run"), "--config", "configs/tiny-cpu.toml",
                           "--set", "run.max_steps=2", "--set", f"data.data_dir={data_dir}", *_DDP_CPU],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-_STDERR_TAIL:]

def _torchrun(*args, launcher=()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *launcher,
            "-m", "stableflash", "train", *args]


_DDP_CPU = ["--set", "run.progress=false", "--set", "attention.backend=sdpa", "--set", "attention.precision=fa2",
            "--set", "run.dtype=fp32", "--set", "monitor.interval=0", "--set", "data.batch_size=4"]


def test_torchrun_resume_on_two_processes_is_bit_exact(tmp_path, data_dir):
    common = ["--config", "configs/tiny-cpu.toml", "--set", f"data.data_dir={data_dir}", "--set",
              "run.checkpoint_interval=0", *_DDP_CPU]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for out, steps in (("straight", 6), ("split", 3)):
        done = subprocess.run(_torchrun("--out", str(tmp_path / out), *common, "--set", f"run.max_steps={steps}"),
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-_STDERR_TAIL:]
    done = subprocess.run(_torchrun("--resume", str(tmp_path / "split"), "--set", "run.max_steps=6"),
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-_STDERR_TAIL:]
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert len(a) == len(b) == 6 and a == b


def _signal_one_rank(run: Path, data_dir, sig: int, *, after_steps: int, checkpoint_interval: int):
    """Start a 2-process run, send `sig` to one worker once `after_steps` steps are logged, wait for the job:
    (returncode, stdout, stderr)."""
    cmd = _torchrun("--config", "configs/tiny-cpu.toml", "--out", str(run), "--set", f"data.data_dir={data_dir}",
                    "--set", "run.max_steps=100000", "--set", f"run.checkpoint_interval={checkpoint_interval}", *_DDP_CPU)
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len(losses(run)) >= after_steps):
            time.sleep(0.2)
        workers = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True)
        pids = [int(p) for p in workers.stdout.split()]
        assert len(pids) == 2, workers.stdout
        os.kill(pids[-1], sig)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def test_torchrun_killed_rank_ends_the_job_and_keeps_the_last_checkpoint(tmp_path, data_dir):
    run = tmp_path / "run"
    returncode, _, _ = _signal_one_rank(run, data_dir, signal.SIGKILL, after_steps=6, checkpoint_interval=2)
    assert returncode != 0, "the job must fail when a rank dies"
    state = load_checkpoint(run)
    assert state["step"] >= 2 and state["step"] % 2 == 0
    # the surviving checkpoint resumes (on one process: the checkpoint does not depend on the world size)
    assert main(["train", "--resume", str(run), "--set", f"run.max_steps={state['step'] + 2}",
                 "--set", "data.grad_accum=2"]) == 0


def test_torchrun_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, data_dir):
    # a signal reaches the ranks at different moments (or only one of them): the ranks agree to stop after
    # the same step, so none waits forever in a collective the others have left
    run = tmp_path / "run"
    returncode, out, err = _signal_one_rank(run, data_dir, signal.SIGTERM, after_steps=4, checkpoint_interval=0)
    assert returncode != 0, err[-2000:]  # the ranks exit 128 + 15, which torchrun reports as a failure
    summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sorted(s["rank"] for s in summaries) == [0, 1]
    assert all(s["stop_reason"].startswith("signal") for s in summaries)
    assert load_checkpoint(run)["step"] == summaries[0]["step"] == summaries[1]["step"] == len(losses(run))


def test_torchrun_monitor_action_switches_the_layer_on_every_rank(tmp_path, data_dir):
    # rank 0's monitor warns (a logit rule set to fire once it has 3 readings) and switches the warned
    # layers to fp32: every rank must switch, or the ranks would train different models
    run, logs = tmp_path / "run", tmp_path / "logs"
    done = subprocess.run(_torchrun("--config", "configs/tiny-cpu.toml", "--out", str(run), "--set",
                                    f"data.data_dir={data_dir}", "--set", "run.max_steps=6", "--set",
                                    "run.checkpoint_interval=0", "--set", "run.progress=false", "--set",
                                    "data.batch_size=4", "--set", "monitor.interval=1", "--set",
                                    "monitor.logit_warn_factor=1e-9", "--set", "monitor.logit_warn_min=0",
                                    "--set", "monitor.action=fp32", launcher=("--log-dir", str(logs), "--redirects", "1")),
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-_STDERR_TAIL:]
    # each rank's stdout in its own file (printed together, the two summaries can interleave)
    summaries = [json.loads(path.read_text().strip().splitlines()[-1]) for path in logs.rglob("stdout.log")]
    assert sorted(s["rank"] for s in summaries) == [0, 1]
    assert summaries[0]["attention"] == summaries[1]["attention"]
    assert all("fp32" in a for a in summaries[0]["attention"]), summaries[0]["attention"]
    assert any(e.get("action") == "fp32" for e in read_jsonl(run / "events.jsonl"))


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_folder(tmp_path, tiny):
    """An error found at step 0 (here: a vocabulary smaller than the data's) removes what the run had written; a
    folder that was there before is kept, empty of run files."""
    with pytest.raises(ValueError, match="model.vocab_size"):
        train(tiny("model.vocab_size=10"), tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="model.vocab_size"):
        train(tiny("model.vocab_size=10"), tmp_path / "mine")
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())


def test_overrides_that_cannot_apply_and_resume_with_out_are_errors(tmp_path, tiny, capsys, monkeypatch):
    from stableflash.cli import main

    with pytest.raises(ValueError, match=r"attention.layers.5: the model has 2 layers"):
        tiny("attention.layers.5.precision=paper")
    with pytest.raises(ValueError, match=r"attention.heads: \[7\] outside the model's"):
        tiny("attention.heads=[7]")
    assert main(["train", "--resume", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "--out: a resumed run keeps its folder and config" in capsys.readouterr().err

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr("stableflash.train.loop.train", out_of_memory)
    assert main(["train", "--config", "tiny-cpu", "--out", str(tmp_path / "big"), "--set", "run.progress=false"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out of memory on cpu for a model of 2 layers" in err


def test_a_time_limit_stops_with_a_checkpoint_that_resumes(tmp_path, tiny):
    summary = train(tiny("run.max_steps=100000", "run.time_limit_s=1", "run.checkpoint_interval=0"), tmp_path / "r")
    assert summary["stop_reason"] == "time limit" and 0 < summary["step"] < 100000
    again = train(tiny(f"run.max_steps={summary['step'] + 2}"), tmp_path / "r", resume=True)
    assert again == {**again, "step": summary["step"] + 2, "stop_reason": "max_steps"}


def test_a_run_refused_a_folder_holding_another_run_leaves_that_run_alone(tmp_path, tiny):
    """The cleanup after a failed start removes only what this run wrote: a folder that already holds a run (here
    without a checkpoint yet) keeps every file when the new run is refused it."""
    folder = tmp_path / "held"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(FileExistsError, match="already holds a run"):
        train(tiny("run.max_steps=2"), folder)
    assert (folder / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'
