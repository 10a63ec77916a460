"""The host side of the kernels (`triton/launch.py`), with the kernels stood in for: no GPU needed."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from stableflash.attention.precision import resolve  # noqa: E402
from stableflash.attention.triton import kernel_options, launch, tuning  # noqa: E402
from stableflash.attention.triton.spec import INTERPRET, spec_name  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[2] / "stableflash"
TILE_PICK_TESTS = Path(__file__).with_name("test_tile_picks.py")
# Triton's internals a launcher would need to replay Triton's own launch: none of it may appear in the package
PRIVATE_TRITON = [r"\.packed_metadata", r"\.arg_names", r"\bkernel\.params\b", r"triton\.knobs", r"runtime\.driver",
                  r"compiled\.run\(", r"\.fn\.params", r"_hooks_registered"]


def test_the_package_uses_no_private_triton_api():
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for path in PACKAGE.rglob("*.py") for n, line in enumerate(path.read_text().splitlines(), 1)
             if any(re.search(pattern, line) for pattern in PRIVATE_TRITON)]
    assert not found, "private Triton API:\n" + "\n".join(found)


def test_every_switch_a_native_launch_passes_is_in_its_autotuners_key(monkeypatch):
    """A masked, padded, packed, grouped or atomic-dQ launch is tuned for itself: each compile-time switch the
    launcher passes (the band's, `GROUP`, `ATOMIC_DQ`) is part of the autotuner's key, so it never reuses the plain
    launch's pick."""
    passed = []
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "hopper", None)
    monkeypatch.setattr(launch, "_launch_tuned", lambda tunable, grid, args, meta, **kw: passed.append((tunable, meta)))
    # the untuned launches (atomic dQ's δ kernel) stood in for too: these are CPU tensors, which a GPU cannot read
    monkeypatch.setattr(launch, "_launch", lambda kernel, grid, args, meta, config: None)
    name = spec_name(resolve("fa2"), None, torch.bfloat16, 64, 77)
    generator = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, 77, 64, generator=generator, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 77, 64, generator=generator, dtype=torch.bfloat16) for _ in range(2))  # GQA
    keep = torch.ones(2, 77, dtype=torch.bool)
    segments = launch.packed_segments([0, 30, 77], [0, 30, 77], q.device)
    for band in (None, launch.band_of(q, k, True, (16, 0), None), launch.band_of(q, k, False, (-1, -1), keep),
                 launch.band_of(q[:1], k[:1], True, (-1, -1), None, segments)):
        qb, kb, vb, db = (t[:1] if band is not None and band.packed else t for t in (q, k, v, dout))
        lse = torch.zeros(qb.shape[:3], dtype=torch.float32)
        launch.forward(qb, kb, vb, True, 0.125, name, False, 1e-3, band=band)
        launch.backward(db, qb, kb, vb, qb, lse, True, 0.125, name, band=band)
        launch.backward(db, qb, kb, vb, qb, lse, True, 0.125, name, band=band, atomic_dq=True)
    switches = {"MASK", "PAD", "SEG", "GROUP", "ATOMIC_DQ"}
    assert switches <= {name for _, meta in passed for name in meta}  # every form was launched
    for tunable, meta in passed:
        missing = (set(meta) & switches) - set(tunable.key)
        assert not missing, f"{tunable.kernel.__name__} is tuned without {sorted(missing)} in its key"


def test_without_autotuning_a_launch_takes_its_kernels_first_candidate(monkeypatch):
    """`KernelOptions(autotune=False)`: a launch without a pick takes the kernel's first candidate tile, with pointer
    loads, records no pick and runs no autotuner; a pick (a resumed run's) still wins."""
    launched = []
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "_launch", lambda kernel, grid, args, meta, config: launched.append((kernel, config)))
    picks = len(tuning.TILE_PICKS)
    with kernel_options(autotune=False):
        for tunable in (tuning.NATIVE_FWD, tuning.NATIVE_DQ, tuning.NATIVE_DKDV):
            launch._launch_tuned(tunable, None, (), {"HEAD_DIM": 64}, T=100, dtype=torch.bfloat16, either=True)
    assert launched == [(t.kernel, t.first) for t in (tuning.NATIVE_FWD, tuning.NATIVE_DQ, tuning.NATIVE_DKDV)]
    assert all(config.kwargs["TMA"] is False for _, config in launched)
    assert len(tuning.TILE_PICKS) == picks


@pytest.mark.skipif(not INTERPRET, reason="without the interpreter test_tile_picks.py runs in this process")
def test_the_tile_pick_tests_run_with_triton_compiled_not_interpreted():
    """The interpreter has no autotuner, so it skips test_tile_picks.py; those tests record launches and run none, so
    a child process without the interpreter runs them on any machine."""
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", str(TILE_PICK_TESTS)],
                           env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0 and " passed" in child.stdout and "skipped" not in child.stdout, child.stdout[-4000:]
