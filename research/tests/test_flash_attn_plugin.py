"""The plugin that picks flash-attn's test cases (`research/flash_attn_shim/upstream_cases.py`), on a synthetic test
file with the same parameter names: what it deselects, what it samples, and the failures it records as they come."""

import gzip
import json
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parents[1] / "flash_attn_shim"

CASES = '''
import pytest

@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("n", range(300))
def test_output(n, alibi, dropout_p):
    assert n != 7, "seven fails"

def test_flash_attn_generator_arg_must_be_none():
    pass
'''


def _pytest(cwd, *args, **env):
    """pytest in a child process with the plugin on and the shim first on the path; `env` adds variables."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "upstream_cases", "-p",
                           "no:cacheprovider", *args], cwd=cwd,
                          env={"PYTHONPATH": str(SHIM), "PATH": "/usr/bin:/bin", **env}, capture_output=True,
                          text=True, timeout=300)


def _run(tmp_path, *options):
    test_file = tmp_path / "test_upstream.py"
    test_file.write_text(CASES)
    counts, failures = tmp_path / "counts.json", tmp_path / "failures.jsonl"
    failures.unlink(missing_ok=True)
    done = _pytest(tmp_path, str(test_file), "--upstream-counts", str(counts), "--upstream-failures", str(failures),
                   *options)
    lines = failures.read_text().splitlines() if failures.exists() else []
    return done, json.loads(counts.read_text())["functions"], [json.loads(line) for line in lines]


def test_dropout_alibi_and_private_entry_points_are_deselected_and_failures_recorded(tmp_path):
    done, counts, failures = _run(tmp_path)
    assert counts == {"test_output": {"in_scope": 300, "run": 300, "resumed": 0}}, done.stdout[-2000:]
    assert "1 failed, 299 passed, 901 deselected" in done.stdout, done.stdout[-2000:]
    assert len(failures) == 1 and "test_output[7-False-0.0]" in failures[0]["case"]
    assert "seven fails" in failures[0]["error"]


def test_a_sample_is_the_same_cases_on_every_run(tmp_path):
    first = _run(tmp_path, "--upstream-sample", "10", "--upstream-whole", "100")
    second = _run(tmp_path, "--upstream-sample", "10", "--upstream-whole", "100")
    run = first[1]["test_output"]["run"]
    assert 10 < run < 60 and second[1]["test_output"]["run"] == run
    assert first[0].stdout.splitlines()[-1].split(" in ")[0] == second[0].stdout.splitlines()[-1].split(" in ")[0]


def test_the_shards_of_a_sample_partition_the_cases(tmp_path):
    """Shards 0..N-1 of one in N run every case in scope exactly once between them: the big function's cases by their
    hash, a small function (here, with --upstream-whole above its size) whole in shard 0 alone."""
    runs = []
    for shard in range(3):
        done, counts, _ = _run(tmp_path, "--upstream-sample", "3", "--upstream-shard", str(shard), "-rA")
        runs.append({line.split(" ")[1] for line in done.stdout.splitlines() if line.startswith(("PASSED", "FAILED"))})
    assert sum(map(len, runs)) == len(set().union(*runs)) == 300, [len(r) for r in runs]
    assert all(len(r) > 50 for r in runs)
    small = _run(tmp_path, "--upstream-sample", "3", "--upstream-shard", "1", "--upstream-whole", "1000")
    assert small[1]["test_output"]["run"] == 0
    assert _run(tmp_path, "--upstream-sample", "3", "--upstream-shard", "3")[0].returncode != 0


GROUPED = '''
import pytest

@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [32, 40, 64, 80, 128])
@pytest.mark.parametrize("n", range(30))
def test_output(n, d, dtype):
    pass

@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("n", range(120))
def test_kvcache(n, d):
    pass
'''


def test_shards_by_parameters_hold_whole_groups_and_partition_the_cases(tmp_path):
    """With --upstream-shard-by d,dtype each (d, dtype) group, across functions, runs in one shard alone; the shards
    partition every case in scope, dealt largest group first to the emptiest shard; an empty name list is refused."""
    (tmp_path / "test_upstream.py").write_text(GROUPED)
    runs = []
    for shard in range(3):
        done = _pytest(tmp_path, "test_upstream.py", "-rA", "--upstream-sample", "3", "--upstream-shard", str(shard),
                       "--upstream-shard-by", "d,dtype", "--upstream-counts", f"counts-{shard}.json")
        runs.append([line.split(" ")[1] for line in done.stdout.splitlines() if line.startswith("PASSED")])
        assert json.loads((tmp_path / f"counts-{shard}.json").read_text())["shard_by"] == ["d", "dtype"]
    cases = [case for run in runs for case in run]
    assert len(cases) == len(set(cases)) == 300 + 240, [len(r) for r in runs]

    def group(case):  # test_output[n-d-dtype] or test_kvcache[n-d]
        params = case.split("[")[1].rstrip("]").split("-")[1:]
        return (params[0], params[1] if len(params) > 1 else None)

    shard_of = {}
    for shard, run in enumerate(runs):
        for case in run:
            assert shard_of.setdefault(group(case), shard) == shard, case
    # groups: (64, None) and (256, None) of 120 cases, ten of 30: the two large ones go to shards 0 and 1 first
    assert shard_of[("64", None)] != shard_of[("256", None)]
    assert sorted(map(len, runs)) == [180, 180, 180]
    refused = _pytest(tmp_path, "test_upstream.py", "--upstream-sample", "3", "--upstream-shard-by", ",")
    assert refused.returncode != 0 and "--upstream-shard-by" in refused.stderr + refused.stdout


def test_the_ledger_adds_up_the_shards(tmp_path):
    """`research/flash_attn_ledger.py` over shards 0..2 of one in 3: every case in scope reported once, the one
    failure among them; a shard run twice counts each case once; a shard of another sample size is refused."""
    sys.path.insert(0, str(SHIM.parent))
    from flash_attn_ledger import ledger

    (tmp_path / "test_upstream.py").write_text(CASES)
    folders = []
    for sample, shard in ((3, 0), (3, 1), (3, 2), (3, 1), (2, 0)):
        folder = tmp_path / f"shard-{sample}-{shard}-{len(folders)}"
        folder.mkdir()
        _pytest(tmp_path, "test_upstream.py", "--upstream-sample", str(sample), "--upstream-shard", str(shard),
                "--upstream-counts", str(folder / "cases.json"), "--junitxml", str(folder / "flash-attn-tests.xml"))
        folders.append(folder)
    whole = ledger(folders[:4])
    assert whole["shards_run"] == [0, 1, 2] and whole["shards_left"] == []
    assert whole["in_scope"] == whole["reported"] == 300
    assert whole["totals"] == {"passed": 299, "failed": 1, "error": 0, "skipped": 0}
    assert whole["worker_seconds_left"] == 0
    assert ledger(folders[:1])["shards_left"] == [1, 2]
    with pytest.raises(ValueError, match="one in 2"):
        ledger(folders)
    grouped = json.loads((folders[1] / "cases.json").read_text()) | {"shard_by": ["n"]}
    (folders[1] / "cases.json").write_text(json.dumps(grouped))
    with pytest.raises(ValueError, match="by \\['n'\\]"):
        ledger(folders[:2])


def test_a_resumed_run_goes_on_where_its_shard_stopped(tmp_path):
    """`--upstream-resume` with an earlier run of the same shard, cut short (its report gzipped, as `results/` stores
    it), leaves out the cases that run passed (a failure runs again): the two runs cover the shard between them, and
    the ledger adds them up to the whole shard's. An earlier run of another shard is refused."""
    sys.path.insert(0, str(SHIM.parent))
    from flash_attn_ledger import ledger

    (tmp_path / "test_upstream.py").write_text(CASES)

    def run(name, shard, *options):
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        done = _pytest(tmp_path, "test_upstream.py", "-rA", "--upstream-sample", "3", "--upstream-shard", str(shard),
                       "--upstream-counts", str(folder / "cases.json"), "--junitxml",
                       str(folder / "flash-attn-tests.xml"), *options)
        return folder, {line.split(" ")[1] for line in done.stdout.splitlines() if line.startswith(("PASSED", "FAILED"))}

    whole, every_case = run("whole", 1)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "cases.json").write_text((whole / "cases.json").read_text())
    report = ElementTree.parse(whole / "flash-attn-tests.xml")
    suite = next(report.iter("testsuite"))
    reported = list(suite.iter("testcase"))
    for case in reported[len(reported) // 2:]:
        suite.remove(case)
    with gzip.open(cut / "flash-attn-tests.xml.gz", "wb") as f:
        report.write(f)
    cut_passed = {f"test_upstream.py::{case.get('name')}" for case in reported[:len(reported) // 2]
                  if case.find("failure") is None}

    resumed, rest = run("resumed", 1, "--upstream-resume", str(cut))
    assert rest == every_case - cut_passed and len(cut_passed) > 10, (len(rest), len(every_case), len(cut_passed))
    counts = json.loads((resumed / "cases.json").read_text())["functions"]["test_output"]
    assert counts["resumed"] == len(cut_passed) and counts["run"] == len(rest)
    added, alone = ledger([cut, resumed]), ledger([whole])
    assert added["reported"] == alone["reported"] == len(every_case) and added["totals"] == alone["totals"]
    refused = _pytest(tmp_path, "test_upstream.py", "--upstream-sample", "3", "--upstream-shard", "2",
                      "--upstream-resume", str(cut))
    assert refused.returncode != 0 and "--upstream-resume" in refused.stdout + refused.stderr


def test_a_resumed_run_runs_the_failures_again(tmp_path):
    """A resumed run leaves out the cases passed before and runs the failed one again; the ledger counts each case as
    the last run reported it."""
    sys.path.insert(0, str(SHIM.parent))
    from flash_attn_ledger import ledger

    (tmp_path / "test_upstream.py").write_text(CASES)
    folders = [tmp_path / "first", tmp_path / "again"]
    for folder, resume in zip(folders, ([], ["--upstream-resume", str(folders[0])])):
        folder.mkdir()
        done = _pytest(tmp_path, "test_upstream.py", "--upstream-counts", str(folder / "cases.json"), "--junitxml",
                       str(folder / "flash-attn-tests.xml"), *resume)
    assert "1 failed" in done.stdout and "passed" not in done.stdout, done.stdout[-2000:]
    counts = json.loads((folders[1] / "cases.json").read_text())["functions"]["test_output"]
    assert counts == {"in_scope": 300, "run": 1, "resumed": 299}
    assert ledger(folders)["totals"] == {"passed": 299, "failed": 1, "error": 0, "skipped": 0}


SHORT_OF_MEMORY = '''
from pathlib import Path


def _tried(name):
    tries = Path(name)
    tries.write_text((tries.read_text() if tries.exists() else "") + "x")
    return len(tries.read_text())


def test_short_of_memory_twice():
    if _tried("short") <= 2:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_wrong():
    _tried("wrong")
    assert False, "wrong everywhere"
'''


def test_a_case_short_of_device_memory_runs_again(tmp_path):
    """With `--upstream-memory-retries 2` a case that runs out of memory twice passes on its third try, each retry in
    its junit record; a plain failure runs once; without the option the first shortage fails the case."""
    sys.path.insert(0, str(SHIM.parent))
    from flash_attn_shim.shard_reports import read_shard

    (tmp_path / "test_upstream.py").write_text(SHORT_OF_MEMORY)
    (tmp_path / "cases.json").write_text(json.dumps({"sample_one_in": 1, "functions": {}}))
    done = _pytest(tmp_path, "test_upstream.py", "--upstream-memory-retries", "2", "--junitxml",
                   "flash-attn-tests.xml")
    assert "1 failed, 1 passed" in done.stdout, done.stdout[-2000:]
    assert (tmp_path / "short").read_text() == "xxx" and (tmp_path / "wrong").read_text() == "x"
    assert read_shard(tmp_path)["memory_retries"] == {"test_upstream::test_short_of_memory_twice": 2}
    (tmp_path / "short").unlink()
    done = _pytest(tmp_path, "test_upstream.py")
    assert "2 failed" in done.stdout and (tmp_path / "short").read_text() == "x", done.stdout[-2000:]


def _shard_folder(folder, sample: int, in_scope: dict, cases: list[tuple[str, float, str]], compiles=()):
    """A shard's output folder as `research/flash_attn_tests.sh` writes it: `cases.json` (shard 0 of one in
    `sample`), the junit report of `cases` ((name, seconds, the testcase element's body)) and `compiles.jsonl`."""
    (folder / "cases.json").write_text(json.dumps({"sample_one_in": sample, "shard": 0, "functions": {
        name: {"in_scope": n} for name, n in in_scope.items()}}))
    (folder / "flash-attn-tests.xml").write_text("<testsuites><testsuite>" + "".join(
        f"<testcase classname='tests.test_flash_attn' name='{n}' time='{t}'>{body}</testcase>" for n, t, body in cases)
        + "</testsuite></testsuites>")
    (folder / "compiles.jsonl").write_text("".join(json.dumps(record) + "\n" for record in compiles))


def test_a_case_has_one_name_in_runs_with_and_without_worker_groups(tmp_path):
    """Runs that sent groups of cases to one worker (pytest-xdist's loadgroup, as some stored runs did) suffixed each
    case's id with its group; the reports read back leave the suffix out, in the junit report and the compiles."""
    sys.path.insert(0, str(SHIM.parent))
    from flash_attn_shim.shard_reports import read_shard

    _shard_folder(tmp_path, 1, {"test_output": 1}, [("test_output[0]@g1234abcd", 1.0, "")],
                  [{"case": "tests/test_flash_attn.py::test_output[0]@g1234abcd", "compiled": 1, "loaded": 0,
                    "compile_s": 2.0}])
    shard = read_shard(tmp_path)
    assert list(shard["outcomes"]) == ["tests.test_flash_attn::test_output[0]"]
    assert list(shard["compiles"]) == ["tests/test_flash_attn.py::test_output[0]"]


def test_the_ledger_projects_the_time_of_the_cases_left(tmp_path):
    """Each function's cases left at its mean time per reported case; a function with none reported is not guessed,
    nor the nameless record junit writes for a case in flight when the run was interrupted."""
    sys.path.insert(0, str(SHIM.parent))
    from flash_attn_ledger import ledger

    _shard_folder(tmp_path, 2, {"test_output": 5, "test_kvcache": 3},
                  [("test_output[0]", 1.5, ""), ("test_output[1]", 2.5, "<failure message='x'/>")])
    report = tmp_path / "flash-attn-tests.xml"
    report.write_text(report.read_text().replace("</testsuite>", "<testcase time='0.001'/></testsuite>"))
    result = ledger([tmp_path])
    assert result["functions"]["test_output"]["worker_seconds"] == 4.0
    assert result["worker_seconds"] == 4.0 and result["worker_seconds_left"] == 3 * 2.0
    assert result["totals"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}


def test_the_ledger_tells_failures_short_of_memory_from_the_others(tmp_path):
    """A failure that ran out of device memory is counted as such; any other is named with its message."""
    sys.path.insert(0, str(SHIM.parent))
    from flash_attn_ledger import ledger

    _shard_folder(tmp_path, 1, {"test_output": 3}, [
        ("test_output[0]", 1.0, "<failure message='torch.OutOfMemoryError: CUDA out of memory. Tried to allocate'/>"),
        ("test_output[1]", 1.0, "<failure message='AssertionError: dq off by 0.5'/>"),
        ("test_output[2]", 1.0, "")])
    causes = ledger([tmp_path])["failures_by_cause"]
    assert causes == {"out_of_memory": 1, "other": 1,
                      "other_cases": {"tests.test_flash_attn::test_output[1]": "AssertionError: dq off by 0.5"}}


LOST_CONTEXT = '''
import os

def test_a_breaks_the_gpu():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

def test_b_runs_after_it():
    with open("pids", "a") as f:
        f.write(f"{os.getpid()}\\n")
'''


def test_a_case_that_loses_the_cuda_context_ends_its_worker(tmp_path):
    """Under pytest-xdist the worker exits after reporting the failure; a fresh one runs the next case."""
    (tmp_path / "test_upstream.py").write_text(LOST_CONTEXT)
    done = _pytest(tmp_path, "test_upstream.py", "-n", "1", "-p", "no:randomly", "--upstream-failures",
                   "failures.jsonl", "--max-worker-restart", "4")
    failures = [json.loads(line) for line in (tmp_path / "failures.jsonl").read_text().splitlines()]
    # the worker's own report, then the controller's of its exit; the next case passes in a fresh worker
    assert [f["case"].split("::")[1] for f in failures] == ["test_a_breaks_the_gpu"] * 2, done.stdout[-2000:]
    assert "illegal memory access" in failures[0]["error"] and "crashed" in failures[1]["error"]
    assert "1 passed" in done.stdout and (tmp_path / "pids").exists(), done.stdout[-2000:]


TILES = '''
from stableflash.attention.triton import kernel_options

def test_tiles():
    with kernel_options() as now:
        assert not now.autotune
'''


def test_fixed_tiles_turn_autotuning_off_in_each_process(tmp_path):
    test_file = tmp_path / "test_tiles.py"
    test_file.write_text(TILES)
    done = _pytest(tmp_path, str(test_file), "--upstream-fixed-tiles", "-n", "2")
    assert "1 passed" in done.stdout, done.stdout[-2000:]


BUILDS = '''
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def _copy(X, Y, n, m, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs * m, tl.load(X + offs, mask=offs < n), mask=offs < n)

def _build():  # as a launch with n divisible by 16 and m = 1 specialises it
    source = ASTSource(_copy, signature={"X": "*fp32", "Y": "*fp32", "n": "i32", "m": "constexpr", "BLOCK": "constexpr"},
                       constexprs={"m": 1, "BLOCK": 16}, attrs={(2,): [["tt.divisibility", 16]]})
    triton.compile(source, target=GPUTarget("cuda", 90, 32))

def test_a_compiles():
    _build()

def test_b_loads_it():
    _build()

def test_c_builds_nothing():
    pass
'''


def test_each_cases_triton_compiles_are_recorded(tmp_path):
    """A case that compiles a kernel (offline, for sm_90: no GPU needed) is recorded with its compile time, one that
    finds it in Triton's on-disk cache as loaded, one that builds nothing not at all."""
    (tmp_path / "test_upstream.py").write_text(BUILDS)
    done = _pytest(tmp_path, "test_upstream.py", "-p", "no:randomly", "--upstream-compiles", "compiles.jsonl",
                   TRITON_CACHE_DIR=str(tmp_path / "cache"))
    assert "3 passed" in done.stdout, done.stdout[-2000:]
    records = {json.loads(line)["case"].split("::")[1]: json.loads(line)
               for line in (tmp_path / "compiles.jsonl").read_text().splitlines()}
    assert sorted(records) == ["test_a_compiles", "test_b_loads_it"]
    assert records["test_a_compiles"]["compiled"] == 1 and records["test_a_compiles"]["compile_s"] > 0
    assert records["test_b_loads_it"]["compiled"] == 0 and records["test_b_loads_it"]["loaded"] == 1
    [kernel] = records["test_a_compiles"]["kernels"]
    assert kernel["kernel"] == "_copy" and kernel["specialisation"] == ["m=1", "n%16"] and len(kernel["key"]) == 16
    assert records["test_b_loads_it"]["kernels"] == []


def test_the_ledger_adds_up_the_compile_time(tmp_path):
    sys.path.insert(0, str(SHIM.parent))
    from flash_attn_ledger import ledger

    _shard_folder(tmp_path, 1, {"test_output": 2}, [(f"test_output[{n}]", 3.0, "") for n in range(2)],
                  [{"case": "tests/test_flash_attn.py::test_output[0]", "compiled": 2, "loaded": 1, "compile_s": 2.5}])
    result = ledger([tmp_path])
    row = result["functions"]["test_output"]
    assert (row["compiled"], row["loaded"], row["compile_seconds"]) == (2, 1, 2.5)
    assert result["compile_seconds"] == 2.5 and result["worker_seconds"] == 6.0
    assert result["load_only_seconds"] == 0


def test_the_ledger_adds_up_the_time_of_cases_that_only_loaded(tmp_path):
    """A case that loaded kernels without compiling any counts whole (under the compile-once manager its time holds
    the wait for another worker's compile); one that compiled, or built nothing, does not."""
    sys.path.insert(0, str(SHIM.parent))
    from flash_attn_ledger import ledger

    _shard_folder(tmp_path, 1, {"test_output": 3}, [(f"test_output[{n}]", 1.0 + n, "") for n in range(3)],
                  [{"case": "tests/test_flash_attn.py::test_output[0]", "compiled": 1, "loaded": 2, "compile_s": 0.5},
                   {"case": "tests/test_flash_attn.py::test_output[1]", "compiled": 0, "loaded": 3, "compile_s": 0.0}])
    assert ledger([tmp_path])["load_only_seconds"] == 2.0


def test_the_ledger_counts_distinct_kernels_and_what_varies_between_them(tmp_path):
    """Two workers building one kernel count as one distinct build; an argument specialised in some builds of a
    kernel but not all is named with how many, one specialised in all of them is not."""
    sys.path.insert(0, str(SHIM.parent))
    from flash_attn_ledger import ledger

    fwd = [{"kernel": "fwd", "key": "a", "specialisation": ["T%16", "stride%16"]},
           {"kernel": "fwd", "key": "b", "specialisation": ["stride%16"]}]
    builds = [[fwd[0]], [fwd[0]], [fwd[1], {"kernel": "dq", "key": "c", "specialisation": ["T%16"]}]]
    _shard_folder(tmp_path, 1, {"test_output": 3}, [(f"test_output[{n}]", 1.0, "") for n in range(3)],
                  [{"case": f"tests/test_flash_attn.py::test_output[{n}]", "compiled": len(k), "loaded": 0,
                    "compile_s": 1.0, "kernels": k} for n, k in enumerate(builds)])
    kernels = ledger([tmp_path])["kernels"]
    assert kernels["fwd"] == {"compiles": 3, "distinct": 2, "varying": {"T%16": 1}}
    assert kernels["dq"] == {"compiles": 1, "distinct": 1, "varying": {}}
