"""One output folder of `research/flash_attn_tests.sh` read back: what the ledger adds up and what a resumed run
leaves out. Each file may be stored gzipped (`results/` keeps them so) under its name plus `.gz`."""

from __future__ import annotations

import gzip
import json
import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path

_OUT_OF_MEMORY = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def out_of_memory(message: str) -> bool:
    """Whether an error's message says the device ran short of memory (PyTorch's allocator, a kernel launch, cuBLAS)."""
    return any(marker in message for marker in _OUT_OF_MEMORY)


_WORKER_GROUP = re.compile(r"@g[0-9a-f]{8}$")
"""The suffix pytest-xdist's `--dist loadgroup` gave a case's id in runs that sent groups of cases to one worker
(`results/drop-ins` holds such runs): left out, so that a case has one name in every run."""


def _open(folder: Path, name: str):
    """`folder/name`, or `folder/name.gz` read through gzip; None where neither exists."""
    if (folder / name).exists():
        return open(folder / name, "rb")
    if (folder / f"{name}.gz").exists():
        return gzip.open(folder / f"{name}.gz", "rb")
    return None


def _outcome(case: ElementTree.Element) -> tuple[str, str]:
    """The case's outcome, and for a failure or an error its message."""
    for child, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        element = case.find(child)
        if element is not None:
            return outcome, element.get("message", "") if outcome in ("failed", "error") else ""
    return "passed", ""


def read_shard(folder: Path) -> dict:
    """One run's sample size, shard number and grouping, cases in scope per function, and per case id
    (`classname::name`, as the junit report names it, without a worker group's suffix) its outcome, seconds and
    Triton compiles; the cases run again after running out of device memory (how many times), and each failure's or
    error's message."""
    folder = Path(folder)
    cases = json.loads((folder / "cases.json").read_text())
    report = _open(folder, "flash-attn-tests.xml")
    if report is None:
        raise FileNotFoundError(f"{folder}: no flash-attn-tests.xml (or .xml.gz)")
    outcomes, seconds, memory_retries, messages = {}, {}, {}, {}
    with report:
        for case in ElementTree.parse(report).iter("testcase"):
            if case.get("name") is None:  # a case in flight when the run was interrupted: junit names none
                continue
            name = f"{case.get('classname')}::{_WORKER_GROUP.sub('', case.get('name'))}"
            outcomes[name], message = _outcome(case)
            if message:
                messages[name] = message
            seconds[name] = float(case.get("time", 0.0))
            retries = sum(p.get("name") == "memory_retry" for p in case.iter("property"))
            if retries:
                memory_retries[name] = retries
    compiles = {}
    listing = _open(folder, "compiles.jsonl")
    if listing is not None:
        with listing:
            for line in listing.read().decode().splitlines():
                record = json.loads(line)
                compiles[_WORKER_GROUP.sub("", record["case"])] = record
    return {"sample": cases["sample_one_in"], "shard": cases.get("shard", 0), "shard_by": cases.get("shard_by"),
            "in_scope": {name: counts["in_scope"] for name, counts in cases["functions"].items()},
            "outcomes": outcomes, "seconds": seconds, "compiles": compiles,
            "memory_retries": memory_retries, "messages": messages}
