"""A non-editable install works from any folder: the presets and the embedded corpus are package data."""

import json
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_wheel_install_trains_from_another_folder(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    # the test's own packages (torch among them) seen from the new venv, also when the test runs inside a venv:
    # --system-site-packages would give the base interpreter's only
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    where = subprocess.run([str(python), "-c", "import stableflash; print(stableflash.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout
    assert str(venv) in where  # the installed copy, not this checkout
    cli = venv / "bin" / "stableflash"
    assert "--no-train" in subprocess.run([str(cli), "demo", "--help"], cwd=tmp_path, capture_output=True,
                                          text=True, check=True).stdout
    run = subprocess.run([str(cli), "train", "--config", "tiny-cpu", "--out", "run", "--set", "run.max_steps=3",
                          "--set", "run.progress=false"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["step"] == 3
    assert (tmp_path / "data" / "shakespeare-char" / "train.bin").exists()  # prepared on first use
