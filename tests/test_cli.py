import json
import subprocess
import sys

from stableflash.cli import main


def test_explain_add_cli_prints_seed_numbers(capsys):
    assert main(["explain-add", "-2.4071154594421387", "-2.296875"]) == 0
    out = capsys.readouterr().out
    for needle in ("-4.703990459442139", "-4.71875", "1100000010010111", "-0.014759540557861328"):
        assert needle in out


def test_explain_add_other_format_and_json(capsys):
    assert main(["explain-add", "1.5", "0.0078125", "--format", "fp8_e4m3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "fp8_e4m3" and data["result"] == 1.5


def test_bad_format_is_a_clear_error(capsys):
    assert main(["explain-add", "1", "2", "--format", "fp12"]) == 2
    assert "fmt: unknown format 'fp12'" in capsys.readouterr().err


def test_python_dash_m_runs():
    done = subprocess.run([sys.executable, "-m", "stableflash", "explain-add", "1", "2"], capture_output=True, text=True)
    assert done.returncode == 0 and "3.0" in done.stdout


def test_demo_numerics_part(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--no-train"]) == 0
    out = capsys.readouterr().out
    assert "-0.014759540557861328" in out and "paper+SFA" in out
    assert (tmp_path / "mechanism.json").exists()


def test_without_pytorch_the_commands_say_they_need_it():
    """With torch not importable, every command answers in one line that PyTorch is missing, not with argparse's
    "invalid choice" or a traceback."""
    code = ("import sys; sys.modules['torch'] = None; from stableflash.cli import main; "
            "raise SystemExit(main(sys.argv[1:]))")
    for argv in (["train", "--config", "tiny-cpu", "--out", "x"], ["demo", "--no-train"], ["diagnose", "spectral"],
                 ["explain-add", "1", "2"]):
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
        assert done.returncode == 2, (argv, done.stderr)
        assert "needs PyTorch" in done.stderr and "Traceback" not in done.stderr, (argv, done.stderr)
