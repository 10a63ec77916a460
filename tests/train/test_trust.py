"""Runs a user can trust: kills and resumes change nothing, run folders are guarded, every error is one line."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from stableflash.cli import main
from stableflash.train.loop import claim_run_folder, train
from stableflash.train.records import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
SHORT = [f"run.max_steps={STEPS}", "monitor.interval=2", "run.checkpoint_interval=5", "run.eval_interval=0"]
LOGS = ("metrics.jsonl", "monitor.jsonl", "events.jsonl")

# Runs `stableflash ARGS...` and SIGKILLs itself at step N ("step N") or inside its Nth checkpoint save, after the
# temporary file is written and before it is renamed ("save N").
KILLER = """
import os, signal, sys
import stableflash.train.loop as loop
mode, n = sys.argv[1], int(sys.argv[2])
if mode == "step":
    original = loop.Trainer.train_step
    def train_step(self, step):
        if step == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, step)
    loop.Trainer.train_step = train_step
else:
    calls, real_replace = [0], os.replace
    def replace(src, dst):
        calls[0] += 1
        if calls[0] == n and ".tmp" in str(src):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)
    os.replace = replace
from stableflash.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _without_timing(rows):
    return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in rows]


def _logs(run: Path) -> dict:
    return {name: _without_timing(read_jsonl(run / name)) for name in LOGS}


def _killed(args, mode, n):
    proc = subprocess.run([sys.executable, "-c", KILLER, mode, str(n), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_dir):
    run = tmp_path_factory.mktemp("whole") / "run"
    overrides = [f"data.data_dir={data_dir}", "run.progress=false", *SHORT]
    assert main(["train", "--config", "tiny-cpu", "--out", str(run), *sum((["--set", o] for o in overrides), [])]) == 0
    logs = _logs(run)
    assert any(e["kind"] == "warning" for e in logs["events.jsonl"])  # the comparison covers the warnings
    return logs, overrides


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_killed_and_resumed_runs_log_what_an_uninterrupted_one_does(tmp_path, uninterrupted, seed):
    reference, overrides = uninterrupted
    rng = random.Random(seed)
    print(f"seed {seed}")
    run = tmp_path / "run"
    sets = sum((["--set", o] for o in overrides), [])
    kills = [("step", rng.randint(6, 14)), ("save", rng.randint(2, 3)), ("step", rng.randint(22, 38))]
    first = True
    for mode, n in kills:
        args = ["train", "--config", "tiny-cpu", "--out", str(run), *sets] if first else ["train", "--resume", str(run)]
        proc = _killed(args, mode, n)
        assert proc.returncode == -9, (mode, n, proc.stderr[-3000:])
        first = False
    assert main(["train", "--resume", str(run)]) == 0
    assert _logs(run) == reference
    assert not list(run.glob("*.tmp*")), list(run.glob("*"))


def test_a_folder_holding_a_run_is_refused_unless_resumed_or_overwritten(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    train(tiny("run.max_steps=3"), run)
    with pytest.raises(FileExistsError, match=f"--out: {run} already holds a run.*--resume {run}.*--overwrite"):
        train(tiny("run.max_steps=3", "run.seed=5"), run)
    assert main(["train", "--config", "tiny-cpu", "--out", str(run), "--set", "run.max_steps=2"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    train(tiny("run.max_steps=2", "run.seed=5"), run, overwrite=True)
    assert [row["step"] for row in read_jsonl(run / "batches.jsonl")] == [0, 1, 2]  # the old batches are gone


def test_a_second_training_into_a_busy_folder_stops_before_writing(tmp_path, tiny):
    run = tmp_path / "run"
    lock = claim_run_folder(run, resume=False)  # as a running training holds it
    try:
        with pytest.raises(BlockingIOError, match=f"--out: {run} is being written by another training \\(pid"):
            train(tiny("run.max_steps=2"), run)
        assert not (run / "metrics.jsonl").exists()
    finally:
        lock.close()
    train(tiny("run.max_steps=2"), run)  # free again once the first is gone


def test_orphaned_temporary_checkpoints_are_removed_at_the_next_start(tmp_path, tiny):
    run = tmp_path / "run"
    train(tiny("run.max_steps=2"), run)
    (run / "checkpoint.pt.tmp12345").write_bytes(b"half a checkpoint")
    train(tiny("run.max_steps=4"), run, resume=True)
    assert not list(run.glob("*.tmp*"))


def test_a_run_replays_its_own_checkpoint(tmp_path, tiny, data_dir):
    run = tmp_path / "run"
    train(tiny("run.max_steps=6", "run.checkpoint_interval=3"), run)
    out = tmp_path / "delta"
    assert main(["diagnose", "delta", "--config", str(run / "config.toml"), "--checkpoint", str(run),
                 "--replay", str(run), "--out", str(out)]) == 0
    assert (out / "delta.json").exists()


def test_threads_are_recorded_fixed_and_checked_on_resume(tmp_path, tiny):
    run = tmp_path / "run"
    train(tiny("run.max_steps=2"), run)
    assert json.loads((run / "run.json").read_text())["threads"] == 1  # deterministic: one thread
    train(tiny("run.max_steps=3", "run.threads=2"), run, resume=True)
    warnings = [e for e in read_jsonl(run / "events.jsonl") if e.get("signal") == "threads"]
    assert warnings and "not bit-exact" in warnings[0]["message"]


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 not a whole zip", random.Random(0).randbytes(512)],
                         ids=["empty", "truncated", "random"])
def test_a_broken_checkpoint_is_named(tmp_path, tiny, capsys, content):
    run = tmp_path / "run"
    train(tiny("run.max_steps=2"), run)
    (run / "checkpoint.pt").write_bytes(content)
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'checkpoint.pt'} is not a readable checkpoint" in err and len(err.splitlines()) == 1


def test_resume_refuses_a_shape_changing_set(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    train(tiny("run.max_steps=2"), run)
    assert main(["train", "--resume", str(run), "--set", "model.n_embd=32"]) == 2
    err = capsys.readouterr().err
    assert "--set" in err and "model.n_embd" in err and len(err.splitlines()) == 1


def test_layer_and_head_are_checked_before_any_work(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    train(tiny("run.max_steps=2"), run)
    common = ["--config", str(run / "config.toml"), "--checkpoint", str(run)]
    assert main(["diagnose", "decompose", *common, "--head", "9", "--out", str(tmp_path / "d")]) == 2
    assert "--head: expected 0..1" in capsys.readouterr().err
    assert main(["diagnose", "delta", *common, "--layer", "7", "--out", str(tmp_path / "e")]) == 2
    assert "--layer: expected 0..1" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_config_mistakes_name_the_file_and_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    cases = {'[model\nn_layer = 2\n': "is not valid TOML", '[model]\nn_layer = "two"\n': "model.n_layer: expected int",
             "[model]\nn_layr = 2\n": "did you mean model.n_layer"}
    for text, expected in cases.items():
        bad.write_text(text)
        assert main(["train", "--config", str(bad), "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert str(bad) in err and expected in err and len(err) < 300, err
    assert main(["train", "--config", "tiny-cpu", "--out", str(tmp_path / "r"), "--set", "optim.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "--set optim.lrr" in err and "did you mean optim.lr" in err and len(err) < 300


def test_openwebtext_without_the_extra_says_how_to_install_it(tmp_path, capsys):
    try:
        import datasets  # noqa: F401
        pytest.skip("the data extra is installed")
    except ImportError:
        pass
    assert main(["prepare", "--dataset", "openwebtext", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--dataset openwebtext" in err and "pip install 'stableflash[data]'" in err


def test_explain_add_takes_negative_infinity_without_a_separator(capsys):
    assert main(["explain-add", "1", "-inf"]) == 2  # a value, refused for what it is: not an option
    assert "expected a finite number" in capsys.readouterr().err


def test_the_previous_checkpoint_is_kept_when_asked(tmp_path, tiny):
    """`run.keep_previous_checkpoint`: the checkpoint before the latest stays, as a whole, loadable checkpoint (after
    a stop on a diverging loss: the state before the divergence)."""
    from stableflash.train.checkpoint import load_checkpoint
    from stableflash.train.loop import PREVIOUS_CHECKPOINT, train

    run = tmp_path / "run"
    train(tiny("run.max_steps=5", "run.checkpoint_interval=2", "run.keep_previous_checkpoint=true"), run)
    assert load_checkpoint(run)["step"] == 5
    assert load_checkpoint(run, name=PREVIOUS_CHECKPOINT)["step"] == 4
    assert not list(run.glob("*.tmp*"))
    other = tmp_path / "other"
    train(tiny("run.max_steps=5", "run.checkpoint_interval=2"), other)
    assert not (other / PREVIOUS_CHECKPOINT).exists()


def test_every_interval_checkpoint_is_kept_when_asked(tmp_path, tiny):
    """`run.keep_interval_checkpoints`: each interval's checkpoint stays as checkpoint-STEP.pt, whole and loadable,
    after later ones replaced the latest (and the stop's own checkpoint is not one of them)."""
    from stableflash.train.checkpoint import load_checkpoint
    from stableflash.train.loop import train

    run = tmp_path / "run"
    train(tiny("run.max_steps=7", "run.checkpoint_interval=3", "run.keep_interval_checkpoints=true"), run)
    kept = sorted(p.name for p in run.glob("checkpoint-*.pt"))
    assert kept == ["checkpoint-000003.pt", "checkpoint-000006.pt"]
    assert [load_checkpoint(run, name=name)["step"] for name in kept] == [3, 6]
    assert load_checkpoint(run)["step"] == 7 and not list(run.glob("*.tmp*"))


def test_a_checkpoint_with_pickled_layer_attentions_still_resumes(tmp_path, tiny):
    """Earlier versions pickled each layer's `LayerAttention` into the checkpoint (now: its config): such a
    checkpoint still resumes, with the attention it saved."""
    from stableflash.train.checkpoint import load_checkpoint, save_checkpoint
    from stableflash.train.config import AttentionConfig

    run = tmp_path / "run"
    train(tiny("run.max_steps=2"), run)
    state = load_checkpoint(run)
    state["attention"] = [AttentionConfig(**saved).layer_attention(None) for saved in state["attention"]]
    save_checkpoint(run, state)
    assert main(["train", "--resume", str(run), "--set", "run.max_steps=3"]) == 0
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m] == [1, 2, 3]
