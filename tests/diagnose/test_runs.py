"""The diagnostics that need training runs: δ trace, spectral history, isolation runner, report, CLI."""

import base64
import json
import math
import re

import pytest
import torch

from stableflash.cli import main
from stableflash.diagnose.bias import BiasAttribution
from stableflash.diagnose.delta import DeltaTrace, delta_trace
from stableflash.diagnose.isolate import EXPERIMENTS, IsolationTable, run_isolation
from stableflash.diagnose.report import build_report
from stableflash.diagnose.spectral import SpectralHistory, spectral_history
from stableflash.train.loop import train

SHORT = ["run.max_steps=6", "monitor.interval=2", "run.eval_interval=0", "run.checkpoint_interval=3"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, data_dir):
    from stableflash.train.config import load_config

    out = tmp_path_factory.mktemp("base")
    cfg = load_config("tiny-cpu", [f"data.data_dir={data_dir}", "run.progress=false", *SHORT])
    train(cfg, out)
    return out, [f"data.data_dir={data_dir}", "run.progress=false", *SHORT]


def test_spectral_history_reads_the_monitor(base_run, tmp_path):
    run, _ = base_run
    history = spectral_history(run)
    assert history.steps == [1, 3, 5]  # monitored every 2 steps, logged after the step
    assert len(history.norms["q"][0]) == 2 and len(history.norms["q"][0][0]) == 2  # layers x heads
    assert history.peak("q") > 0
    assert SpectralHistory.load(history.save(tmp_path / "s.json")) == history
    with pytest.raises(FileNotFoundError, match="monitor.jsonl"):
        spectral_history(tmp_path)


def test_delta_trace_follows_replayed_steps(base_run, tiny, tmp_path):
    run, overrides = base_run
    cfg = tiny(*SHORT, "run.max_steps=12")
    # the checkpoint is at step 6, past the run's recorded batches: the seeded data continues from there
    trace = delta_trace(cfg, run, None, steps=3, layer=1)
    assert trace.steps == [6, 7, 8]
    assert len(trace.cumulative) == 3 and len(trace.cumulative[0]) == cfg.model.n_head
    assert trace.cumulative[-1][0] == pytest.approx(sum(s[0] for s in trace.sums))
    assert DeltaTrace.load(trace.save(tmp_path / "delta-trace.json")) == trace
    with pytest.raises(ValueError, match="layer"):
        delta_trace(cfg, run, None, steps=1, layer=5)


def test_isolation_runs_the_whole_list_and_resumes(base_run, tmp_path):
    run, overrides = base_run
    table = run_isolation("tiny-cpu", tmp_path / "iso", replay=run, overrides=overrides, layer=1)
    assert [r["experiment"] for r in table.rows] == list(EXPERIMENTS)
    for row in table.rows:
        assert row["steps"] == 6 and row["final_loss"] > 0 and row["peak_wq_spectral_norm"] > 0
        assert row["grad_spike_steps"] == 0 and 0 < row["peak_grad_norm"] < 100  # a calm tiny run
    # every experiment saw the same replayed batches
    batches = {(tmp_path / "iso" / name / "batches.jsonl").read_text() for name in EXPERIMENTS}
    assert len(batches) == 1
    saved = IsolationTable.load(tmp_path / "iso" / "isolation.json")
    assert saved.rows == json.loads(json.dumps(table.rows))
    assert "| heads-fp32 |" in (tmp_path / "iso" / "isolation.md").read_text()
    # a second call finds every summary and trains nothing
    mtimes = {n: (tmp_path / "iso" / n / "metrics.jsonl").stat().st_mtime_ns for n in EXPERIMENTS}
    run_isolation("tiny-cpu", tmp_path / "iso", replay=run, overrides=overrides, layer=1)
    assert mtimes == {n: (tmp_path / "iso" / n / "metrics.jsonl").stat().st_mtime_ns for n in EXPERIMENTS}


def test_isolation_in_parallel_processes_matches_one_process(base_run, tmp_path):
    """Bit for bit at the workers' thread count: on a CPU the last bits of a run depend on how many threads its
    kernels use (at 2 threads against the workers' 1, a final loss differed by 6e-5 on one CI machine and not on
    another), so the one process runs on one thread too."""
    run, overrides = base_run
    names = "baseline,fp32,sfa"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = run_isolation("tiny-cpu", tmp_path / "one", experiments=names, replay=run, overrides=overrides, layer=1)
    finally:
        torch.set_num_threads(threads)
    spread = run_isolation("tiny-cpu", tmp_path / "two", experiments=names, replay=run, overrides=overrides, layer=1,
                           jobs=3)
    assert [r["experiment"] for r in spread.rows] == names.split(",")
    for a, b in zip(here.rows, spread.rows):
        assert b["final_loss"] == a["final_loss"], a["experiment"]


def test_isolation_from_a_checkpoint(base_run, tmp_path):
    run, overrides = base_run
    table = run_isolation("tiny-cpu", tmp_path / "iso", experiments="baseline,fp32,qk-norm", checkpoint=run,
                          overrides=[*overrides, "run.max_steps=9"])
    rows = {r["experiment"]: r for r in table.rows}
    assert "skipped" in rows["qk-norm"]
    assert rows["baseline"]["steps"] == 3  # continued from the checkpoint at step 6 to step 9
    # the experiment's attention, not the one recorded in the checkpoint, ran
    assert rows["fp32"]["final_loss"] != rows["baseline"]["final_loss"]
    with pytest.raises(ValueError, match="--experiments: unknown"):
        run_isolation("tiny-cpu", tmp_path / "x", experiments="warp-drive", overrides=overrides)


def test_bias_attribution_on_a_trained_head(base_run, tmp_path, data_dir):
    from stableflash.diagnose.bias import bias_at_head
    from stableflash.train.config import load_config

    run, overrides = base_run
    cfg = load_config("tiny-cpu", overrides)
    head, result = bias_at_head(cfg, run, layer=1, policy="paper")
    assert head in (0, 1)
    parts = sum(r["o"]["mean"] for r in result.sites) + result.remainder["o"]["mean"]
    assert parts == pytest.approx(result.total["o"]["mean"], abs=1e-9)  # contributions + interactions = total
    with pytest.raises(ValueError, match="head: expected 0..1"):
        bias_at_head(cfg, run, layer=1, head=2)
    args = ["diagnose", "bias", "--config", "tiny-cpu", "--checkpoint", str(run), "--layer", "1", "--head", "0",
            "--out", str(tmp_path / "b"), *[a for o in overrides for a in ("--set", o)]]
    assert main(args) == 0
    assert BiasAttribution.load(tmp_path / "b" / "bias.json").policy == "paper"


def test_policy_errors_at_a_checkpoint_script(base_run, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    run, overrides = base_run
    script = Path(__file__).resolve().parents[2] / "research" / "policy_errors_at_checkpoint.py"
    subprocess.run([sys.executable, str(script), "--config", "tiny-cpu", "--checkpoint", str(run), "--out",
                    str(tmp_path / "e.json"), *[a for o in overrides for a in ("--set", o)]],
                   check=True, capture_output=True, text=True, timeout=300)
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert {r["layer"] for r in rows} == {0, 1} and len({r["policy"] for r in rows}) == len(rows) // 2
    for r in rows:  # a young tiny model: small logits, every policy's backward probabilities sum to ~1
        assert r["rows_p_sum_above_1.5"] == 0 and r["p_sum_max"] < 1.05 and math.isfinite(r["dq_rel_err"]), r["policy"]
    err = {(r["layer"], r["policy"]): r["dq_rel_err"] for r in rows}
    assert all(err[layer, "fa2"] < err[layer, "bf16"] for layer in (0, 1))


def test_report_embeds_every_figure(base_run, tmp_path):
    run, _ = base_run
    assert main(["diagnose", "bias", "--ties", "3", "--keys", "64", "--out", str(tmp_path / "diag")]) == 0
    assert main(["diagnose", "bias", "--ties", "2", "--keys", "64", "--out", str(tmp_path / "diag" / "two")]) == 0
    assert main(["diagnose", "pv-trace", "--ties", "3", "--keys", "64", "--out", str(tmp_path / "diag")]) == 0
    assert main(["diagnose", "spectral", str(run), "--out", str(tmp_path / "diag")]) == 0
    assert main(["diagnose", "condition", "--arms", "B4,C4", "--heads", "1", "--out", str(tmp_path / "diag")]) in (0, 1)
    (tmp_path / "diag" / "delta-trace.json").write_text(json.dumps(
        {"kind": "DeltaTrace", "low": "paper", "high": "fp64", "layer": 0, "steps": [0, 1],
         "sums": [[0.1, -0.2], [0.3, 0.1]], "cumulative": [[0.1, -0.2], [0.4, -0.1]]}))
    (tmp_path / "diag" / "errors").mkdir()
    (tmp_path / "diag" / "errors" / "errors.json").write_text(json.dumps(
        {"layer": 0, "low": "paper", "high": "fp64", "estimate_steps": 1, "steps": [4, 5],
         "cumulative_delta_error": [[0.1, 0.0], [0.3, 0.1]], "wq_drift_along_r": [[0.2, -0.1]]}))
    out = build_report([run, tmp_path / "diag"], tmp_path / "report.html")
    page = out.read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    # loss, spectral heat map, repeated maxima vs loss, the attention counters, δ cumulative sum, P̄V trace,
    # spectral.json's heat map, the errors trace
    assert len(images) == 8
    assert "The seed's condition (diag, condition-synthetic)" in page and "Errors over training (diag/errors)" in page
    assert all(base64.b64decode(img)[:8] == b"\x89PNG\r\n\x1a\n" for img in images)
    assert "Bias attribution (diag)" in page and "Bias attribution (diag/two)" in page and "<table>" in page
    assert "Spectral norms (diag)" in page
    with pytest.raises(FileNotFoundError, match="RUN_DIR"):
        build_report([tmp_path / "nope"], tmp_path / "r.html")


def test_cli_diagnose_delta_takes_the_runs_own_attention_with_low_config(base_run, tmp_path):
    """`--low config`: δ's error under the attention the config trains with (here the P̄V path in e8m3 and SFA), not
    under `paper`: another policy's name in the trace, other errors."""
    run, overrides = base_run
    traces = {}
    for low, extra in (("paper", []), ("config", ["attention.sites.pv=e8m3", "attention.stabilize=sfa"])):
        sets = [a for o in [*overrides, "run.max_steps=12", *extra] for a in ("--set", o)]
        assert main(["diagnose", "delta", "--config", "tiny-cpu", "--checkpoint", str(run), "--steps", "1",
                     "--low", low, "--out", str(tmp_path / low), *sets]) == 0
        traces[low] = json.loads((tmp_path / low / "delta-trace.json").read_text())
    assert traces["paper"]["low"] == "paper"
    assert "pv=e8m3" in traces["config"]["low"] and traces["config"]["low"].endswith("+SFA")
    assert traces["config"]["cumulative"] != traces["paper"]["cumulative"]


def test_cli_diagnose_delta_and_decompose(base_run, tmp_path, capsys):
    run, overrides = base_run
    sets = [a for o in [*overrides, "run.max_steps=12"] for a in ("--set", o)]
    assert main(["diagnose", "delta", "--config", "tiny-cpu", "--checkpoint", str(run),
                 "--steps", "2", "--out", str(tmp_path / "d"), *sets]) == 0
    assert (tmp_path / "d" / "delta.json").exists() and (tmp_path / "d" / "delta-trace.json").exists()
    assert main(["diagnose", "decompose", "--config", "tiny-cpu", "--checkpoint", str(run),
                 "--steps", "2", "--layer", "1", "--head", "1", "--out", str(tmp_path / "d"), *sets]) == 0
    study = json.loads((tmp_path / "d" / "decompose.json").read_text())
    assert len(study["decompositions"]) == 2 and len(study["alignment"]) == 1
    assert "residual" in capsys.readouterr().out
    page = build_report([tmp_path / "d"], tmp_path / "report.html").read_text()
    assert "W_Q gradient error, decomposed (d)" in page and "signed alignment" in page
