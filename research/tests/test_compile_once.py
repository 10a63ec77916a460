"""The cache manager under which the flash-attn shards' workers compile each Triton kernel once between them
(`research/flash_attn_shim/compile_once.py`): a miss holds the kernel's lock until its group is written, a waiter
loads what the holder wrote, and a holder that never writes lets go when it is collected."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parents[1] / "flash_attn_shim"
sys.path.insert(0, str(SHIM))
compile_once = pytest.importorskip("compile_once")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    return tmp_path


def _waiting(manager, filename):
    """`manager.get_group(filename)` in a thread: (the thread, a list that receives the group)."""
    got = []
    thread = threading.Thread(target=lambda: got.append(manager.get_group(filename)), daemon=True)
    thread.start()
    return thread, got


def test_a_miss_holds_the_kernel_until_its_group_is_written_and_the_waiter_loads_it(cache):
    holder = compile_once.CompileOnceCacheManager("kernel")
    assert holder.get_group("k.json") is None
    thread, got = _waiting(compile_once.CompileOnceCacheManager("kernel"), "k.json")
    time.sleep(0.5)
    assert thread.is_alive(), "a second miss on the same kernel did not wait for the first"
    path = holder.put(json.dumps({"name": "k"}), "k.json", binary=False)
    holder.put_group("k.json", {"k.json": path})
    thread.join(10)
    assert got and got[0] == {"k.json": path}


def test_other_kernels_do_not_wait(cache):
    holder = compile_once.CompileOnceCacheManager("one")
    assert holder.get_group("k.json") is None
    thread, got = _waiting(compile_once.CompileOnceCacheManager("another"), "k.json")
    thread.join(5)
    assert got == [None]


def test_a_holder_that_never_writes_lets_go_when_collected(cache):
    holder = compile_once.CompileOnceCacheManager("kernel")
    assert holder.get_group("k.json") is None
    thread, got = _waiting(compile_once.CompileOnceCacheManager("kernel"), "k.json")
    time.sleep(0.3)
    assert thread.is_alive()
    del holder  # a compile that raised: its manager goes with its frame
    thread.join(10)
    assert got == [None], "the waiter should have taken the lock, found no group and compiled"


COMPILE = '''
import json, os, sys, time
from pathlib import Path
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def _scale(X, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < n) * 2, mask=offs < n)

builds = []
triton.knobs.compilation.listener = lambda *, cache_hit, **_: builds.append("loaded" if cache_hit else "compiled")
while not Path("go").exists():
    time.sleep(0.01)
triton.compile(ASTSource(_scale, signature={"n": "i32", "X": "*fp32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 64}),
               target=GPUTarget("cuda", 90, 32))
print(json.dumps(builds))
'''


def test_processes_that_miss_one_kernel_at_once_compile_it_once(tmp_path):
    """Three processes sharing a cache compile one kernel for sm_90 (on the CPU) at the same moment: one compiles, the
    others load its build."""
    (tmp_path / "build.py").write_text(COMPILE)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(SHIM), "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "TRITON_CACHE_MANAGER": "compile_once:CompileOnceCacheManager", "HOME": str(tmp_path)}
    workers = [subprocess.Popen([sys.executable, "build.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(3)]
    time.sleep(3)  # past the imports
    (tmp_path / "go").touch()
    outcomes = []
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err[-2000:]
        outcomes += json.loads(out.strip().splitlines()[-1])
    assert sorted(outcomes) == ["compiled", "loaded", "loaded"], outcomes
