"""The research scripts run end to end on the CPU (tiny config, a few steps)."""

import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_sweep_runs_in_parallel_and_prints_the_verdict(tmp_path):
    out = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, str(ROOT / "research" / "sweep.py"), "--out", str(out), "--config", "tiny-cpu",
         "--settings", "ref-paper,fp32", "--seeds", "0,1", "--jobs", "2", "--keep-runs", "--verdict", "ref-paper:fp32",
         "--set", "run.max_steps=3", "--set", "monitor.interval=1", "--set", "run.eval_interval=0"],
        capture_output=True, text=True, timeout=300, check=True)
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert [(r["setting"], r["seed"]) for r in runs] == [("ref-paper", 0), ("fp32", 0), ("ref-paper", 1), ("fp32", 1)]
    assert all(r["steps"] == 3 and not r["failed"] for r in runs)
    assert "failed ref-paper 0/2" in result.stdout
    assert "reproduction rule (ref-paper fails in >= 2/3, fp32 in 0/3): not decided (fewer than 3 seeds)" in result.stdout
    kept = sorted(p.name for p in (out / "runs").iterdir())
    assert kept == ["000-ref-paper-seed0", "001-fp32-seed0", "002-ref-paper-seed1", "003-fp32-seed1"]
    assert not (out / "runs" / kept[0] / "checkpoint.pt").exists() and (out / "runs" / kept[0] / "metrics.jsonl").exists()
    study = subprocess.run([sys.executable, str(ROOT / "research" / "warning_study.py"), str(out / "runs"),
                            "--out", str(tmp_path / "w.json")], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads((tmp_path / "w.json").read_text())
    assert result["runs"] == 4 and result["blowups"] == 0 and result["healthy"] == 4
    assert "4 runs; 0 blow-ups" in study.stdout
    signals = {row["signal"] for row in result["calibration"]}
    assert signals == {"max_logit", "grad_norm", "repeated_max", "score_resolution"}
    assert all(row["explosion"]["caught"] == "0/0" and row["blowup"]["false_alarms"].endswith("/4")
               for row in result["calibration"])
    bad = subprocess.run([sys.executable, str(ROOT / "research" / "sweep.py"), "--out", str(tmp_path / "x"),
                          "--settings", "warp"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--settings: unknown ['warp']" in bad.stderr


def test_attention_benchmark_summary_reprints_the_ratio_table_without_a_gpu(tmp_path):
    rows = [{"shape": [1, 2, 256, 64], "impl": impl, "fwd_tflops": 1.0, "fwdbwd_tflops": eager,
             "fwd_tflops_cudagraph": 1.0, "fwdbwd_tflops_cudagraph": graph}
            for impl, eager, graph in [("stableflash", 100.0, 200.0), ("stableflash-sfa", 90.0, 190.0),
                                       ("stableflash-sfa-stats", 81.0, 180.5), ("stableflash-paper", 20.0, 21.0),
                                       ("sdpa-flash", 60.0, 95.0), ("sdpa-cudnn", 120.0, 200.0)]]
    rows.append({"shape": [1, 2, 256, 64], "impl": "torch-tiled-paper", "fwd_tflops": 1.0, "fwdbwd_tflops": 2.0})
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--summary", str(path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    # eager: SFA 90 against FA2 60, cuDNN 120, plain 100; statistics 81 against SFA 90; paper 20 against tiled 2
    assert out[out.index("eager") + 1:out.index("eager") + 6] == ["1.50x", "0.75x", "10.0%", "10.0%", "10.00x"]
    assert out[out.index("graph") + 1:out.index("graph") + 6] == ["2.00x", "0.95x", "5.0%", "5.0%", "10.00x"]


def test_attention_ab_gives_time_after_over_before_per_round_and_for_the_mean(tmp_path):
    def bench(name, sfa, cudnn):
        rows = [{"shape": [4, 16, 4096, 128], "impl": "stableflash-sfa", "fwdbwd_tflops_cudagraph": sfa,
                 "fwdbwd_tflops": None},
                {"shape": [4, 16, 4096, 128], "impl": "sdpa-cudnn", "fwdbwd_tflops_cudagraph": cudnn}]
        path = tmp_path / name
        path.write_text(json.dumps({"meta": {}, "rows": rows}))
        return str(path)

    before = [bench("b1.json", 300.0, 450.0), bench("b2.json", 310.0, 450.0)]
    after = [bench("a1.json", 400.0, 450.0), bench("a2.json", 310.0, 450.0)]
    out = subprocess.run([sys.executable, str(ROOT / "research" / "attention_ab.py"), "--before", *before,
                          "--after", *after, "--out", str(tmp_path / "ab.json")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    rows = {row["impl"]: row for row in json.loads((tmp_path / "ab.json").read_text())}
    # time after / before is TFLOP/s before / after: the mean's (305 / 355) and each round's (300 / 400, 310 / 310)
    assert rows["stableflash-sfa"]["time_ratio"] == pytest.approx(305 / 355)
    assert rows["stableflash-sfa"]["round_ratios"] == pytest.approx([0.75, 1.0])
    assert rows["sdpa-cudnn"]["time_ratio"] == pytest.approx(1.0)
    assert set(r["column"] for r in rows.values()) == {"fwdbwd_tflops_cudagraph"}  # the eager column is empty
    assert "0.859  0.750, 1.000" in out
    short = subprocess.run([sys.executable, str(ROOT / "research" / "attention_ab.py"), "--before", *before,
                            "--after", after[0]], capture_output=True, text=True, timeout=60)
    assert short.returncode != 0 and "before, after: need as many rounds of each, got 2 and 1" in short.stderr


def test_tree_rounds_runs_each_arm_in_its_tree_round_by_round(tmp_path):
    """Each arm's benchmark runs in its own tree (its package first on the path), with its one environment setting,
    once per round in the order given; a missing tree is named."""
    stub = ("import json, os, sys\n"
            "args = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
            "open(args['--out'], 'w').write(json.dumps({'tree': os.path.basename(os.getcwd()),\n"
            "    'chunk': os.environ.get('CHUNK'), 'path': os.environ['PYTHONPATH'], 'args': args}))\n")
    for tree in ("a", "b"):
        (tmp_path / tree / "benchmarks").mkdir(parents=True)
        (tmp_path / tree / "benchmarks" / "attention.py").write_text(stub)
    out = tmp_path / "out"
    script = str(ROOT / "research" / "tree_rounds.sh")
    subprocess.run(["bash", script, str(out), "2", "x,y", "fwdbwd_graph", "1,2,64,64", f"first={tmp_path / 'a'}",
                    f"second={tmp_path / 'b'}@CHUNK=8"], check=True, capture_output=True, text=True, timeout=60)
    runs = {name: json.loads((out / f"attention-{name}.json").read_text())
            for name in ("first-1", "second-1", "first-2", "second-2")}
    assert [runs[n]["tree"] for n in runs] == ["a", "b", "a", "b"]
    assert [runs[n]["chunk"] for n in runs] == [None, "8", None, "8"]
    assert runs["first-1"]["path"] == "." and runs["second-2"]["args"] == {
        "--impls": "x,y", "--modes": "fwdbwd_graph", "--shapes": "1,2,64,64", "--out": str(out / "attention-second-2.json")}
    order = [line.split(":")[0] for line in (out / "rounds.log").read_text().splitlines()]
    assert order == ["round 1 arm first", "round 1 arm second", "round 2 arm first", "round 2 arm second"]
    missing = subprocess.run(["bash", script, str(out), "1", "x", "fwd", "1,2,64,64", f"gone={tmp_path / 'c'}"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and f"arm gone: no tree at {tmp_path / 'c'}" in missing.stderr


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="exports a commit of this checkout's git history")
def test_make_tree_exports_a_commit_with_its_patches_applied(tmp_path):
    patch = tmp_path / "new-file.patch"
    patch.write_text("--- /dev/null\n+++ b/research/made.txt\n@@ -0,0 +1 @@\n+patched\n")
    tree = tmp_path / "tree"
    script = str(ROOT / "research" / "make_tree.sh")
    made = subprocess.run(["bash", script, str(tree), "HEAD", str(patch)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    assert (tree / "research" / "made.txt").read_text() == "patched\n" and "with 1 patch" in made.stdout
    assert (tree / "stableflash" / "__init__.py").exists() and not (tree / "results").exists()
    again = subprocess.run(["bash", script, str(tree)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and not (tree / "research" / "made.txt").exists()  # made afresh
    broken = subprocess.run(["bash", script, str(tree), "HEAD", str(patch), str(patch)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert broken.returncode != 0  # the second copy of the patch does not apply


def test_backward_forms_compare_pairs_each_tile_of_two_trees(tmp_path):
    def row(kernel, tma, registers, spills):
        return {"kernel": kernel, "head_dim": 128, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3,
                "TMA": tma, "registers": registers, "spill_stack_bytes": spills, "shared_bytes": 1024, "wgmma": 72,
                "ld_shared": 1, "st_shared": 2, "tma_loads": 3, "barriers": 4}

    before = tmp_path / "before.json"
    after = tmp_path / "after.json"
    before.write_text(json.dumps({"rows": [row("dkdv", True, 255, 24), row("dkdv", False, 255, 80)]}))
    after.write_text(json.dumps({"rows": [{**row("dkdv", True, 253, 0), "serialised": "yes"},
                                          row("dq", True, 200, 0)]}))
    out = subprocess.run([sys.executable, str(ROOT / "research" / "backward_forms.py"), "--compare", str(before),
                          str(after)], capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    # the dK/dV TMA tile is in both tables; the dq row has no before and the pointer row no after; the older table
    # has no serialisation column
    assert len(out) == 2 and out[1].startswith("dkdv D=128 64x128 8w 3s TMA")
    assert "255 -> 253" in out[1] and "24 -> 0" in out[1] and out[1].endswith("? -> yes")
    bad = subprocess.run([sys.executable, str(ROOT / "research" / "backward_forms.py"), "--kernels", "fwd", "--out",
                          str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--kernels: unknown ['fwd']; expected dkdv, dq" in bad.stderr


def test_train_throughput_summary_judges_each_row_by_its_own_rounds_baseline(tmp_path):
    """Rounds interleaved on a drifting machine: each row against the latest baseline run before it, then the
    median, least and largest of those ratios per setting (an older JSON without the ratios is filled in)."""
    rates = [("sdpa", 100.0), ("ours", 99.0), ("sdpa", 80.0), ("ours", 84.0), ("sdpa", 90.0), ("ours", 81.0)]
    rows = [{"setting": name, "steps": 10, "tokens_per_s": rate, "first_loss": 5.0, "last_loss": 4.0}
            for name, rate in rates]
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--summary", str(path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    in_round = [line.split()[4] for line in out.splitlines() if line.startswith("ours ") and "->" in line]
    assert in_round == ["0.990", "1.050", "0.900"]
    assert out.splitlines()[-1].split() == ["ours", "3", "rounds", "median", "0.990", "least", "0.900", "largest", "1.050"]


def test_emulation_agreement_reports_bit_equal_fractions(tmp_path):
    """The emulation report runs on the CPU under Triton's interpreter and writes a fraction per output."""
    out = tmp_path / "agreement.json"
    subprocess.run([sys.executable, str(ROOT / "research" / "emulation_agreement.py"), "--shapes", "1,2,70,16",
                    "--draws", "1", "--variants", "paper+pv32", "--out", str(out)],
                   env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300, check=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["sfa"]) for r in rows] == [("paper+pv32", False), ("paper+pv32", True)]
    for row in rows:
        assert all(0.95 <= row[what]["min"] <= row[what]["mean"] <= 1.0 for what in ("out", "dq", "dk", "dv"))


def test_emulation_agreement_takes_the_official_rule_on_the_tests_tied_rows(tmp_path):
    """The report's settings: the official rule, not causal, other tiles, the GPU tests' tied rows (one draw of dO
    each); a shape with more than one batch row is refused for tied rows."""
    out = tmp_path / "agreement.json"
    command = [sys.executable, str(ROOT / "research" / "emulation_agreement.py"), "--draws", "2", "--variants", "fa2",
               "--stabilize", "official", "--causal", "no", "--tiles", "64", "--inputs", "tied,tied-below-zero",
               "--out", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([*command, "--shapes", "1,2,77,64"], env=env, capture_output=True, text=True, timeout=300,
                   check=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["stabilize"], r["causal"], r["tiles"], r["inputs"]) for r in rows] == [
        ("official", False, 64, "tied"), ("official", False, 64, "tied-below-zero")]
    for row in rows:
        assert all(len(row[what]["draws"]) == 2 and 0.5 <= row[what]["min"] <= 1.0 for what in ("out", "dq", "dk", "dv"))
    refused = subprocess.run([*command, "--shapes", "2,2,77,64"], env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--shapes" in refused.stderr


def test_dose_response_runs_its_arms_resumes_them_and_applies_its_rule(tmp_path):
    """Two arms of the study on the tiny CPU config (the reference backend: no GPU): a first call trains them to
    step 20 and checkpoints, the next resumes them to 40, one more is cut by its budget; `summarise` then writes one
    JSON per arm, the figure and the verdict's parts."""
    out = tmp_path / "dose"
    common = [sys.executable, str(ROOT / "research" / "dose_response.py"), "run", "--out", str(out), "--config",
              "tiny-cpu", "--arms", "paper,e8m4-sr", "--seeds", "0", "--set", "run.checkpoint_interval=10",
              "--set", "monitor.interval=5", "--set", "attention.backend=reference", "--budget-s", "240"]
    for steps in (20, 40):
        subprocess.run([*common, "--steps", str(steps)], capture_output=True, text=True, timeout=300, check=True)
        for folder in (out / "runs").iterdir():
            records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1)), folder.name
    first = [json.loads(line) for line in (out / "runs" / "paper-s0" / "metrics.jsonl").read_text().splitlines()]
    subprocess.run([*common, "--steps", "100000", "--budget-s", "5"], capture_output=True, text=True, timeout=300,
                   check=True)  # stopped by the budget: each run keeps what it had checkpointed
    again = [json.loads(line) for line in (out / "runs" / "paper-s0" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in again if "loss" in r][:40] == [r for r in first if "loss" in r]
    subprocess.run([sys.executable, str(ROOT / "research" / "dose_response.py"), "finish", str(out), "--budget-s", "240"],
                   capture_output=True, text=True, timeout=300, check=True)  # δ per arm: no run diverged
    result = subprocess.run([sys.executable, str(ROOT / "research" / "dose_response.py"), "summarise", str(out)],
                            capture_output=True, text=True, timeout=120, check=True)
    for arm in ("paper", "e8m4-sr"):
        (run,) = json.loads((out / "arms" / f"{arm}.json").read_text())
        assert run["steps"] >= 40 and run["first_divergence"] is None and run["wq_growth"] is not None
    config = (out / "runs" / "e8m4-sr-s0" / "config.toml").read_text()
    assert 'rounding = "stochastic"' in config and 'pv = "e8m4"' in config
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["parts"]["e8m4 diverges in >= 2 of 3"] is False and not verdict["training_parts_met"]
    assert verdict["signatures"] == {"status": "no failing run"} and verdict["reproduced"] is False
    for arm, delta in verdict["delta_per_arm"].items():  # each arm's δ under its own numerics
        assert delta["steps"] == 10 and math.isfinite(delta["cumulative"]), arm
    assert "stochastic" in verdict["delta_per_arm"]["e8m4-sr"]["low"]
    assert "stochastic" not in verdict["delta_per_arm"]["paper"]["low"]
    assert (out / "dose-response.png").exists() and "e8m4-sr" in result.stdout
    subprocess.run([sys.executable, str(ROOT / "research" / "dose_response.py"), "pack", str(out),
                    str(tmp_path / "dose.tgz")], capture_output=True, text=True, timeout=120, check=True)
    with tarfile.open(tmp_path / "dose.tgz") as archive:
        names = archive.getnames()
    assert "dose/verdict.json" in names and "dose/runs/paper-s0/metrics.jsonl" in names
    assert any(n.startswith("dose/delta/") for n in names) and not any(n.endswith(".pt") for n in names)


def test_dose_response_divergence_rule():
    sys.path.insert(0, str(ROOT / "research"))
    from study_runs import first_divergence

    assert first_divergence([5.0, 4.0, 3.0, 3.5, 3.9]) is None
    assert first_divergence([5.0, 4.0, 3.0, 4.0]) == 3  # 1.0 above the best so far
    assert first_divergence([5.0, float("nan")]) == 1


def test_dose_response_names_the_diverging_step_as_the_metrics_count_it(tmp_path):
    sys.path.insert(0, str(ROOT / "research"))
    from study_runs import summarise_run

    run = tmp_path / "run"
    run.mkdir()
    losses = [5.0, 4.0, 3.0, 4.5, 4.6]
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n"
                                               for i, x in enumerate(losses)))
    assert summarise_run(run)["first_divergence"] == 4  # step 4's loss is 1.5 above the best
    (run / "events.jsonl").write_text(json.dumps({"step": 2, "kind": "stop", "reason": "loss spike"}) + "\n")
    assert summarise_run(run)["first_divergence"] == 2  # the trainer's stop, earlier


def test_dose_response_points_the_diagnosis_at_the_first_divergence(tmp_path):
    sys.path.insert(0, str(ROOT / "research"))
    from dose_response import diagnosis_commands

    arms = {"e8m4": [{"run": "e8m4-s0", "first_divergence": 900, "wq_growth": {"layer": 2}},
                     {"run": "e8m4-s1", "first_divergence": None, "wq_growth": None}],
            "e8m3": [{"run": "e8m3-s0", "first_divergence": 400, "wq_growth": {"layer": 1}}]}
    (tmp_path / "runs" / "e8m3-s0").mkdir(parents=True)
    for step in (250, 399, 400, 500):  # kept interval checkpoints: 399 trained steps come just before step 400
        (tmp_path / "runs" / "e8m3-s0" / f"checkpoint-{step:06d}.pt").touch()
    delta, isolate = diagnosis_commands(tmp_path, arms)
    assert "e8m3-s0/checkpoint-000399.pt" in delta and "--layer 1" in delta
    assert "isolate" in isolate and "--from-checkpoint" in isolate and "run.max_steps=500" in isolate
    for step in (250, 399):
        (tmp_path / "runs" / "e8m3-s0" / f"checkpoint-{step:06d}.pt").unlink()
    (only,) = diagnosis_commands(tmp_path, arms)  # no checkpoint before: the isolation from the initialisation
    assert "isolate" in only and "--from-checkpoint" not in only
    assert diagnosis_commands(tmp_path, {"fp32": [{"run": "fp32-s0", "first_divergence": 5, "wq_growth": None}]}) == []


def test_dose_response_measures_delta_in_every_arm_before_any_divergence(tmp_path):
    sys.path.insert(0, str(ROOT / "research"))
    from dose_response import delta_commands

    arms = {"e8m3": [{"run": "e8m3-s1", "first_divergence": None, "wq_growth": None},
                     {"run": "e8m3-s0", "first_divergence": 400, "wq_growth": {"layer": 1}}],
            "fp32": [{"run": "fp32-s0", "first_divergence": None, "wq_growth": {"layer": 4}}]}
    (tmp_path / "runs" / "e8m3-s0").mkdir(parents=True)
    (tmp_path / "runs" / "e8m3-s0" / "checkpoint-000250.pt").touch()
    e8m3, fp32 = delta_commands(tmp_path, arms)
    assert "e8m3-s0/checkpoint-000250.pt" in e8m3 and "--layer 1" in e8m3 and str(tmp_path / "delta" / "e8m3") in e8m3
    assert "fp32-s0/checkpoint.pt" in fp32 and "--layer 4" in fp32


def test_dose_response_signatures_read_the_first_failing_runs_delta_trace(tmp_path):
    sys.path.insert(0, str(ROOT / "research"))
    from dose_response import signatures

    def failing(cumulative, repeated):
        run = {"run": "e8m4-s0", "first_divergence": 300, "wq_growth": {"layer": 1, "head": 2},
               "monitor_steps": [100, 200, 300],
               "attention": [[None, {"repeated_max_rows": [0, 0, n, 0]}] for n in (repeated, repeated, 99)]}
        trace = {"low": "paper+pv=e8m4", "layer": 1, "steps": [240, 241], "sums": [], "cumulative": [[0] * 4, cumulative]}
        (tmp_path / "diagnose-delta").mkdir(exist_ok=True)
        (tmp_path / "diagnose-delta" / "delta-trace.json").write_text(json.dumps(trace))
        return signatures(tmp_path, {"e8m4": [run], "fp32": [run | {"first_divergence": 10}]})

    seed_like = failing([0.1, -0.2, 0.5, 0.0], repeated=3)
    assert seed_like["run"] == "e8m4-s0" and seed_like["met"] and seed_like["repeated_max_rows_before"] == 6
    other_head = failing([0.1, -0.2, 0.5, 0.9], repeated=3)
    assert not other_head["parts"]["that head's W_Q grows most and has the largest δ error"]
    negative = failing([0.1, -0.2, -0.5, -0.9], repeated=0)  # the divergence step's own count is not read
    assert not negative["parts"]["positive cumulative δ error at the failing head"] and not negative["met"]
    assert not negative["parts"]["rows with a repeated maximum in that head"]
    assert signatures(tmp_path, {"fp32": [{"first_divergence": 10}]}) == {"status": "no failing run"}


def test_dose_response_verdict_counts_a_run_stopped_short_as_not_holding():
    sys.path.insert(0, str(ROOT / "research"))
    from dose_response import SHORTEST_HOLD, verdict

    def runs(*steps, diverged=None):
        return [{"steps": s, "first_divergence": diverged} for s in steps]

    arms = {"fp32": runs(SHORTEST_HOLD, SHORTEST_HOLD + 1, SHORTEST_HOLD - 1), "e8m4-sr": runs(900, 900, 900),
            "e8m4": runs(700, 700, diverged=300), "e8m3": runs(400, 400, 400, diverged=200)}
    result = verdict(arms)
    assert result["parts"]["fp32 holds in 3 of 3"] is False  # one seed stopped before SHORTEST_HOLD
    assert result["parts"]["e8m4-sr holds in 3 of 3"] is True
    assert result["parts"]["e8m3 before e8m4"] is True and result["parts"]["e8m4 diverges in >= 2 of 3"] is True
    assert result["runs_stopped_short_without_divergence"] == {"fp32": [SHORTEST_HOLD - 1]}


def test_dose_response_reads_every_run_at_one_common_step():
    sys.path.insert(0, str(ROOT / "research"))
    from dose_response import COMMON_WINDOW, SHORTEST_HOLD, at_common_step

    def run(name, steps, diverged=None, wq=1.0):
        losses = [3.0] * steps
        if diverged:
            losses[diverged - 1:] = [9.0] * (steps - diverged + 1)
        return {"run": name, "steps": steps, "first_divergence": diverged, "losses": losses,
                "grad_norms": [float(i) for i in range(steps)], "monitor_steps": [1, steps],
                "wq_spectral": [[[0.5, 0.5]], [[wq, 0.5]]]}

    common = SHORTEST_HOLD + 30
    arms = {"short": [run("short-s0", SHORTEST_HOLD - 1)],  # below the floor: does not set the common step
            "late": [run("late-s0", common + 50, diverged=common + 10, wq=7.0)],
            "early": [run("early-s0", common, diverged=common - 5)]}
    result = at_common_step(arms)
    assert result["step"] == common
    assert result["arms"]["short"] == [None]
    (late,) = result["arms"]["late"]
    assert not late["diverged"] and late["loss"] == 3.0 and late["grad_norm_max"] == common - 1
    assert late["wq_max"] == 0.5  # the monitor's last record up to the common step, not its later one
    (early,) = result["arms"]["early"]
    expected_loss = (3.0 * (COMMON_WINDOW - 6) + 9.0 * 6) / COMMON_WINDOW
    assert early["diverged"] and abs(early["loss"] - expected_loss) < 1e-12
    assert at_common_step({"short": [run("short-s0", 10)]}) == {}


def test_plot_results_redraws_the_dose_response_figure_from_the_arms_json(tmp_path):
    sys.path.insert(0, str(ROOT / "research"))
    from plot_results import plot_dose_response

    def run(name, wq):
        return {"run": name, "steps": 3, "first_divergence": None, "losses": [5.0, 4.0, 3.0], "monitor_steps": [1, 3],
                "wq_spectral": [[[0.5, 0.5]], [[wq, 0.5]]], "wq_growth": {"layer": 0, "head": 0, "ratio": wq / 0.5}}

    (tmp_path / "arms").mkdir()
    for arm in ("e8m4", "fp32"):
        (tmp_path / "arms" / f"{arm}.json").write_text(json.dumps([run(f"{arm}-s0", 2.0), run(f"{arm}-s1", 3.0)]))
    figure = plot_dose_response(tmp_path)
    assert figure == tmp_path / "dose-response.png" and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bias_vs_noise_runs_its_arms_finishes_and_applies_its_rule(tmp_path):
    """Two arms on the tiny CPU config (the reference backend): trained to a step target, the failing-or-first B
    run's condition check and errors from its checkpoint, C's errors, then the verdict and the figure."""
    out = tmp_path / "study"
    script = str(ROOT / "research" / "bias_vs_noise.py")
    subprocess.run([sys.executable, script, "run", "--out", str(out), "--config", "tiny-cpu", "--arms", "B3,C3",
                    "--seeds", "0", "--steps", "12", "--set", "run.checkpoint_interval=6", "--set",
                    "monitor.interval=3", "--set", "attention.backend=reference", "--set",
                    "run.keep_interval_checkpoints=true", "--budget-s", "240"],
                   capture_output=True, text=True, timeout=300, check=True)
    config = (out / "runs" / "B3-s0" / "config.toml").read_text()
    assert 'v_operand = "e8m3"' in config and 'pv = "e8m3"' in config
    assert 'rounding = "stochastic"' in (out / "runs" / "C3-s0" / "config.toml").read_text()
    sys.path.insert(0, str(ROOT / "research"))
    import bias_vs_noise
    from study_runs import collect

    commands = bias_vs_noise.finish_commands(out, collect(out))
    assert [c.split()[2] for c in commands] == ["condition", "errors", "errors"]
    commands = [c.replace(f"--steps {bias_vs_noise.ERROR_STEPS}", "--steps 2") for c in commands]
    from study_runs import run_commands
    run_commands(commands, out / "finish-logs", 240)
    result = subprocess.run([sys.executable, script, "summarise", str(out), "--steps", "12"], capture_output=True,
                            text=True, timeout=120, check=True)
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["outcome"] == "inconclusive" and verdict["first_divergence"] == {"B3": [None], "C3": [None]}
    assert verdict["signature"]["status"] == "measured" and verdict["signature"]["run"] == "B3-s0"
    assert verdict["manipulation_check_on_the_gpu"] in (True, False)
    assert set(verdict["errors"]) == {"B3-s0", "C3-s0"} and verdict["errors"]["B3-s0"]["steps"] == 2
    assert (out / "bias-vs-noise.png").exists() and "B3" in result.stdout


def test_seed_scale_runs_ddp_on_two_processes_resumes_and_summarises(tmp_path):
    """The seed-scale command on the CPU: torchrun with 2 processes (gloo) and the tiny config, 4 steps, then a
    second call resumes the same run to 8; the summary holds every step's loss and gradient norm and the monitor's
    per-head records; the projection prints hours for 1, 4 and 8 GPUs."""
    script = str(ROOT / "research" / "seed_scale.py")
    tiny = ["--config", "tiny-cpu", "--nproc", "2", "--set", "run.device=cpu", "--set", "data.dataset=shakespeare-char",
            "--set", f"data.data_dir={tmp_path / 'data'}", "--set", "data.batch_size=2", "--set", "monitor.interval=2",
            "--set", "model.vocab_size=256"]
    for steps in (4, 8):
        done = subprocess.run([sys.executable, script, "run", str(tmp_path / "scale"), "--steps", str(steps),
                               "--budget-s", "240", *tiny], capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{steps} steps on 2 process(es)" in done.stdout
    config = (tmp_path / "scale" / "paper" / "config.toml").read_text()
    assert "grad_accum = 8" in config and 'precision = "paper"' in config  # 16 accumulation steps over 2
    subprocess.run([sys.executable, script, "summary", str(tmp_path / "scale"), str(tmp_path / "s.json")], check=True,
                   capture_output=True, text=True, timeout=60)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["steps"] == list(range(1, 9)) and all(math.isfinite(x) for x in doc["loss"] + doc["grad_norm"])
    assert [r["step"] for r in doc["monitor"]] == [1, 3, 5, 7]
    assert len(doc["monitor"][0]["wq"]) == 2 and "biasable_rows" in doc["monitor"][0]["attention"][0]
    shown = subprocess.run([sys.executable, script, "project", "--tokens-per-s", "350000"], capture_output=True,
                           text=True, check=True).stdout
    assert "1 GPU:" in shown and "8 GPUs:" in shown and "2.78" in shown  # 3.5e9 / 350000 / 3600 on one GPU


@pytest.mark.parametrize("launches", ["stood-in", "triton"])
def test_host_time_compares_two_trees(tmp_path, launches):
    """research/host_time.py on the CPU: both trees (here the same one) measured in child processes, with Triton's
    launches stood in for or its own launch path through a stand-in driver (the kernels compiled for sm_90), a row
    per call and part, and the JSON; a tree without stableflash/ is refused by name."""
    out = tmp_path / "host.json"
    done = subprocess.run([sys.executable, str(ROOT / "research" / "host_time.py"), "--before", str(ROOT), "--after",
                           str(ROOT), "--rounds", "1", "--repeats", "20", "--launches", launches, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, check=True, cwd=tmp_path)
    assert json.loads(out.read_text())["machine"]["launches"] == launches
    summary = json.loads(out.read_text())["summary"]
    assert sorted(summary) == sorted(f"{call}/{part}" for call in ("fa2", "sfa", "sfa-stats")
                                     for part in ("fwd_bwd_us", "fwd_us", "bwd_us"))
    assert all(row["before_us"] > 0 and row["after_us"] > 0 for row in summary.values())
    assert "sfa-stats" in done.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "research" / "host_time.py"), "--before", str(tmp_path), "--out",
                          str(out)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected a folder holding stableflash/" in bad.stderr


def test_host_floor_times_ours_against_empty_ops_of_the_same_design(tmp_path):
    """research/host_floor.py on the CPU: the three arms in every round, each round's ratio to `ours`, the JSON;
    the floor's ops give every input a gradient of its shape, as ours do."""
    out = tmp_path / "floor.json"
    done = subprocess.run([sys.executable, str(ROOT / "research" / "host_floor.py"), "--rounds", "2", "--repeats", "20",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, check=True, cwd=tmp_path)
    result = json.loads(out.read_text())
    assert [sorted(r) for r in result["rounds"]] == [["floor", "function", "ours"]] * 2
    assert result["summary"]["ours"]["to_ours"] == 1.0
    assert all(row["median_us"] > 0 for row in result["summary"].values())
    assert "floor" in done.stdout and "function" in done.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "research" / "host_floor.py"), "--rounds", "0", "--out", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--rounds and --repeats: expected at least 1, got 0 and 2000" in bad.stderr
    grads = subprocess.run([sys.executable, "-c", (
        "import torch, host_floor\n"
        "q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))\n"
        "host_floor.floor_fwd(q, k, v, None, 'n', 'c')[0].sum().backward()\n"
        "print([tuple(t.grad.shape) for t in (q, k, v)])")],
        capture_output=True, text=True, timeout=120, check=True, cwd=ROOT / "research").stdout
    assert grads.strip() == "[(1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)]"


def test_forward_overhead_fit_recovers_a_cost_per_program_and_units_count_causal_tiles():
    sys.path.insert(0, str(ROOT / "research"))
    from forward_overhead import SHAPES, fit, program_share, units

    assert units(1, 1, 384) == 6 and units(2, 3, 128) == 6  # n = 3: 1 + 2 + 3 tiles; n = 1: one per head
    assert {B * H * T * T for B, H, T in SHAPES} == {2**29}  # equal FLOPs at every T
    xs = [program_share(T) for _, _, T in SHAPES]
    line = fit(xs, [2.0 + 3.0 * x for x in xs])
    assert math.isclose(line["a_us"], 2.0) and math.isclose(line["b_over_a"], 1.5)
    assert max(abs(e) for e in line["residuals"]) < 1e-9
    bent = fit(xs, [2.0 + 3.0 * x + (0.5 if x == xs[2] else 0.0) for x in xs])
    assert max(abs(e) for e in bent["residuals"]) > 0.05  # a point off the line shows in its residual


def test_eager_gap_summarises_a_call_by_its_kernels_busy_time_and_span():
    sys.path.insert(0, str(ROOT / "research"))
    from eager_gap import call_summary

    # three kernels, out of order, the second overlapping the first: busy 9 µs over a span of 12
    assert call_summary([(10, 2), (0, 5), (3, 2)]) == {"kernels": 3, "busy_us": 9, "span_us": 12}
