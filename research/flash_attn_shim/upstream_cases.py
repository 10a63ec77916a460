"""A pytest plugin for flash-attn's `tests/test_flash_attn.py` run against the stand-in package: which cases run,
and what a cut-short run still tells.

Deselected, each counted in the summary line pytest prints:
- cases with dropout (`dropout_p` > 0) or ALiBi (`alibi` True): stableflash supports neither and refuses them;
- tests of flash-attn's compiled extension's private entry points (`_flash_attn_varlen_forward`,
  `flash_attn_gpu.fwd`), which are not part of its Python API;
- with `--upstream-sample N`, all but one case in N of each test function, picked by a hash of the case's id (the
  same cases on every run whose rootdir is the same: pytest writes the id relative to it), where the function has
  more than `--upstream-whole` cases in scope (those run whole).
  `--upstream-shard K` (0 <= K < N) picks the cases whose hash leaves K: shards 0 to N - 1 partition every case in
  scope (the small functions run whole in shard 0), so runs of successive shards cover the file between them.
- with `--upstream-shard-by d,dtype` as well, the shards hold whole groups instead: the large functions' cases that
  share the named parameters' values form one group, across functions (a case without such a parameter has None
  there), and the groups are dealt to the N shards largest first, each to the shard with the fewest cases so far.
  Each case compiles the kernels of its head dim and dtype, so grouped shards compile disjoint sets of kernels,
  where shards by hash each compile nearly all of them.

`--upstream-resume DIR` (repeatable) names an earlier run of the same shard, an output folder as
`research/flash_attn_tests.sh` writes it: the cases its junit report holds a pass or a skip for are left out, so a run
cut short by a time limit goes on where it stopped instead of compiling and running its first cases again. Its failed
and errored cases run again: a failure is confirmed or mended by the later run, which the ledger counts (the last of a
shard's runs to report a case wins). A folder of another shard, sample size or grouping is refused.

`--upstream-memory-retries N`: each case returns the memory its process's allocator holds cached to the device when
it ends, and a case that runs out of device memory (16 workers share one GPU; the file's largest cases take GBs) runs
again after a pause, up to N times. Each retry is written into the case's junit record as a `memory_retry` property,
so the ledger counts the cases that needed one.

`--upstream-counts FILE` writes, per test function, the cases in scope, the cases run and the cases left out as
passed or skipped by an earlier run (`resumed`) as JSON (under
pytest-xdist the workers collect, and each writes the same file). `--upstream-failures FILE` appends one JSON line
per failed case as it fails (its id and its error's message), so that a run cut short by a time limit still says
why each case failed. A case that leaves the GPU unusable (a CUDA error: an illegal address, a launch failure) ends
its worker after it is reported, so that pytest-xdist starts a fresh one and the later cases do not inherit the
broken CUDA context. `--upstream-fixed-tiles` launches every kernel at its first candidate tile instead of
autotuning each of the file's many shapes (`KernelOptions.autotune`): the cases test results, not speed.

`--upstream-compiles FILE` appends one JSON line per case that made Triton build a kernel: how many it compiled and
the seconds that took, and how many it loaded from Triton's on-disk cache (Triton's `knobs.compilation.listener`).
With the cases' times (the junit report) this says how much of a run is compiling, which a warm cache would save.
Each compile is listed too (`kernels`): the kernel's name, its cache key, and the runtime arguments Triton
specialised it on (`specialisation`), so that a ledger can count the distinct kernels and say what multiplies them.
"""

import functools
import json
import os
import sys
import time
import xml.etree.ElementTree as ElementTree
import zlib
from collections import Counter
from pathlib import Path

import pytest
from shard_reports import out_of_memory, read_shard

PRIVATE_ENTRY_POINTS = ("test_flash_attn_varlen_paged_kv_num_splits", "test_flash_attn_generator_arg_must_be_none")
CONTEXT_LOST = ("illegal memory access", "illegal address", "unspecified launch failure", "CUDA error: misaligned",
                "device-side assert")
MEMORY_PAUSE_S = 1.0  # before a case's first retry, growing with each: other workers' cases finish meanwhile
_failures_path = None  # `--upstream-failures`, read at configure time (a report hook gets no config)
_controller = False  # pytest-xdist's controller: its workers record their own failures, it records their crashes
_builds = Counter()  # this process's Triton builds during the running case: compiled, loaded, compile_us
_built = []  # the kernels it compiled during the running case (`_kernel_record`)


def pytest_addoption(parser):
    parser.addoption("--upstream-sample", type=int, default=1, help="run one case in N of each large test function")
    parser.addoption("--upstream-shard", type=int, default=0, help="with --upstream-sample N, the shard K < N: the "
                     "cases whose hash modulo N is K")
    parser.addoption("--upstream-shard-by", default=None, help="with --upstream-sample N, deal whole groups of cases "
                     "to the shards: the cases sharing these comma-separated parameters' values (say, d,dtype)")
    parser.addoption("--upstream-whole", type=int, default=100, help="functions with at most this many cases in "
                     "scope run whole")
    parser.addoption("--upstream-resume", action="append", default=[], help="an earlier run's output folder of this "
                     "same shard (its cases.json and flash-attn-tests.xml): the cases it reported passed or skipped "
                     "are left out; repeatable")
    parser.addoption("--upstream-memory-retries", type=int, default=0, help="free each case's cached device memory "
                     "when it ends, and run a case that ran out of device memory again, up to this many times")
    parser.addoption("--upstream-counts", default=None, help="write the per-function counts to this JSON file")
    parser.addoption("--upstream-failures", default=None, help="append each failure to this JSON-lines file")
    parser.addoption("--upstream-fixed-tiles", action="store_true", help="launch the kernels untuned, at their "
                     "first candidate tile")
    parser.addoption("--upstream-compiles", default=None, help="append each case's Triton compiles to this JSON-lines "
                     "file")


def _in_scope(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return not (params.get("dropout_p", 0.0) > 0 or params.get("alibi", False) is True
                or item.originalname in PRIVATE_ENTRY_POINTS)


def _group(item, names: tuple[str, ...]) -> tuple[str, ...]:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return tuple(repr(params.get(name)) for name in names)


def _dealt_groups(items, names: tuple[str, ...], every: int) -> dict[tuple[str, ...], int]:
    """Each group's shard: largest group first, to the shard with the fewest cases so far (the lowest on a tie)."""
    sizes = Counter(_group(item, names) for item in items)
    load, shard_of = [0] * every, {}
    for group, size in sorted(sizes.items(), key=lambda entry: (-entry[1], entry[0])):
        shard_of[group] = min(range(every), key=lambda k: (load[k], k))
        load[shard_of[group]] += size
    return shard_of


def _settled(folders, shard: dict) -> set[str]:
    """The cases (`function[parameters]`, as junit names them) that earlier runs of this shard, the last to report
    each, reported passed or skipped; `shard` is this run's sample size, shard and grouping, as `cases.json` holds
    them."""
    outcomes = {}
    for folder in folders:
        try:
            earlier = read_shard(Path(folder))
        except (OSError, ValueError, KeyError, ElementTree.ParseError) as error:
            raise pytest.UsageError(f"--upstream-resume {folder}: expected an earlier run's output folder with "
                                    f"cases.json and flash-attn-tests.xml ({error})") from error
        theirs = {"sample_one_in": earlier["sample"], "shard": earlier["shard"], "shard_by": earlier["shard_by"]}
        if theirs != shard:
            raise pytest.UsageError(f"--upstream-resume {folder}: a run of {theirs}, expected one of this run's shard "
                                    f"{shard}")
        outcomes.update({case.split("::")[-1]: outcome for case, outcome in earlier["outcomes"].items()})
    return {name for name, outcome in outcomes.items() if outcome in ("passed", "skipped")}


def pytest_collection_modifyitems(config, items):
    every, whole = config.getoption("--upstream-sample"), config.getoption("--upstream-whole")
    shard = config.getoption("--upstream-shard")
    if not 0 <= shard < every:
        raise pytest.UsageError(f"--upstream-shard: expected 0 <= K < --upstream-sample ({every}), got {shard}")
    by = config.getoption("--upstream-shard-by")
    names = tuple(name.strip() for name in by.split(",") if name.strip()) if by else ()
    if by is not None and not names:
        raise pytest.UsageError(f"--upstream-shard-by: expected comma-separated parameter names, got {by!r}")
    in_scope = [item for item in items if _in_scope(item)]
    per_function = Counter(item.originalname for item in in_scope)
    large = [item for item in in_scope if per_function[item.originalname] > whole]
    if names:
        shard_of = _dealt_groups(large, names, every)
        picked = {id(item) for item in large if shard_of[_group(item, names)] == shard}
    else:
        picked = {id(item) for item in large if zlib.crc32(item.nodeid.encode()) % every == shard}
    kept = [item for item in in_scope if (shard == 0 if per_function[item.originalname] <= whole
                                          else id(item) in picked)]
    this_shard = {"sample_one_in": every, "shard": shard, "shard_by": list(names) or None}
    settled = _settled(config.getoption("--upstream-resume"), this_shard)
    resumed = Counter(item.originalname for item in kept if item.name in settled)
    kept = [item for item in kept if item.name not in settled]
    config._upstream_counts = (per_function, Counter(item.originalname for item in kept), resumed)
    if config.getoption("--upstream-counts"):
        with open(config.getoption("--upstream-counts"), "w") as f:
            json.dump({**this_shard, "whole_below": whole,
                       "functions": {name: {"in_scope": n, "run": config._upstream_counts[1][name],
                                            "resumed": resumed[name]}
                                     for name, n in sorted(per_function.items())}}, f, indent=1)
    kept_ids = {id(item) for item in kept}
    dropped = [item for item in items if id(item) not in kept_ids]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(trylast=True)  # after pytest-xdist has sent the report on
def pytest_runtest_logreport(report):
    if not report.failed:
        return
    text = str(report.longrepr)
    if _controller and "crashed while running" not in text:
        return
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)  # "AssertionError: ..."
    error = crash or next((line for line in reversed(text.splitlines()) if line.strip()), "")
    if _failures_path:
        with open(_failures_path, "a") as f:
            f.write(json.dumps({"case": report.nodeid, "when": report.when, "error": error[:500]}) + "\n")
    if any(marker in text for marker in CONTEXT_LOST) and os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(3)  # after this report: xdist replaces the worker, the next cases get a working CUDA context


def pytest_configure(config):
    global _failures_path, _controller
    _failures_path = config.getoption("--upstream-failures")
    _controller = bool(getattr(config.option, "numprocesses", None)) and "PYTEST_XDIST_WORKER" not in os.environ
    if config.getoption("--upstream-fixed-tiles"):
        from stableflash.attention.triton import set_kernel_options
        set_kernel_options(autotune=False)
    if config.getoption("--upstream-compiles") and not _controller:
        import triton
        triton.knobs.compilation.listener = _count_build


def _count_build(*, src, metadata, metadata_group, times, cache_hit):
    if cache_hit:
        _builds["loaded"] += 1
    else:
        _builds["compiled"] += 1
        _builds["compile_us"] += times.total
        _built.append(_kernel_record(src))


def specialisation(src) -> list[str]:
    """The runtime arguments Triton specialised a build on, as `name%16` (divisible by 16) or `name=1`, a tuple's
    elements as `name[i]`; the kernel's declared constexprs are left out (the launch's choice, not Triton's)."""
    fn = src.fn

    def label(path):
        return fn.arg_names[path[0]] + "".join(f"[{i}]" for i in path[1:])

    declared = {i for i, p in enumerate(fn.params) if p.is_constexpr}
    ones = [f"{label(path)}=1" for path, value in src.constants.items() if path[0] not in declared and value == 1]
    divisible = [f"{label(path)}%16" for path, attributes in src.attrs.items()
                 if ["tt.divisibility", 16] in [list(a) for a in attributes]]
    return sorted(ones + divisible)


def _kernel_record(src) -> dict:
    return {"kernel": src.name, "key": src.hash()[:16], "specialisation": specialisation(src)}


def _free_cached_memory() -> None:
    """Return the device memory PyTorch's caching allocator holds to the device, for the other workers' cases."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _retrying_on_memory(item, test, retries: int):
    """`test`, run again after a pause where it runs out of device memory, up to `retries` times."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        for attempt in range(retries + 1):
            try:
                return test(*args, **kwargs)
            except Exception as error:
                if attempt == retries or not out_of_memory(str(error)):
                    raise
                item.user_properties.append(("memory_retry", str(error).splitlines()[0][:200]))
                _free_cached_memory()
                time.sleep(MEMORY_PAUSE_S * (attempt + 1))
    return run


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    retries = item.config.getoption("--upstream-memory-retries")
    if retries > 0 and isinstance(item, pytest.Function):
        item.obj = _retrying_on_memory(item, item.obj, retries)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if item.config.getoption("--upstream-memory-retries") > 0:
        _free_cached_memory()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _builds.clear()
    _built.clear()
    yield
    path = item.config.getoption("--upstream-compiles")
    if path and _builds:
        with open(path, "a") as f:
            f.write(json.dumps({"case": item.nodeid, "compiled": _builds["compiled"], "loaded": _builds["loaded"],
                                "compile_s": round(_builds["compile_us"] / 1e6, 3), "kernels": _built}) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = getattr(config, "_upstream_counts", None)
    if counts is None:  # an xdist worker's summary, or nothing collected
        return
    in_scope, run, resumed = counts
    terminalreporter.write_sep("-", "flash-attn's cases outside dropout and ALiBi: in scope, run, reported before")
    for name in sorted(in_scope):
        terminalreporter.write_line(f"{name}: {in_scope[name]} in scope, {run[name]} run, {resumed[name]} reported "
                                    "before")
    terminalreporter.write_line(f"total: {sum(in_scope.values())} in scope, {sum(run.values())} run, "
                                f"{sum(resumed.values())} reported before")
