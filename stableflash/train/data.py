"""Token memmaps (nanoGPT's train.bin / val.bin, uint16), their preparation, and deterministic batches.

The batch of step s is a pure function of (seed, s): its `global_batch` sequence
offsets are drawn from a generator seeded with (seed, s), and each rank takes
its slice. So a 2-process run and a 1-process run with the same global batch see
the same sequences, and a run can be replayed from its recorded offsets.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

EMBEDDED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "shakespeare.txt.xz"
DATASETS = ("shakespeare-char", "debian-docs", "openwebtext")


def write_memmaps(token_chunks: Iterable[np.ndarray], out_dir: Path, val_fraction: float, meta: dict) -> dict:
    """Write train.bin / val.bin from an iterable of uint16 token arrays; the last `val_fraction` is val."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate([np.asarray(c, dtype=np.uint16) for c in token_chunks])
    if tokens.size < 2:
        raise ValueError("the corpus produced fewer than 2 tokens")
    split = int(tokens.size * (1 - val_fraction))
    # each writer its own temporary files, each file replaced atomically, meta.json (what readers check) last: runs
    # that start together in a fresh folder may all prepare the embedded corpus at once
    unique = f".tmp{os.getpid()}-{threading.get_ident()}"
    for name, part in (("train", tokens[:split]), ("val", tokens[split:])):
        tmp = out_dir / f"{name}.bin{unique}"
        part.tofile(tmp)
        tmp.replace(out_dir / f"{name}.bin")
    meta = {**meta, "train_tokens": int(split), "val_tokens": int(tokens.size - split),
            "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()}
    tmp = out_dir / f"meta.json{unique}"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(out_dir / "meta.json")
    return meta


def prepare_embedded(out_dir: Path, val_fraction: float = 0.05) -> dict:
    """Byte-level tokens of the embedded Shakespeare corpus (no network needed)."""
    text = lzma.decompress(EMBEDDED_CORPUS.read_bytes())
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    return write_memmaps([tokens], out_dir, val_fraction,
                         {"dataset": "shakespeare-char", "tokenizer": "bytes", "vocab_size": 256})


def ensure_embedded(data_dir: Path) -> TokenData:
    """The embedded corpus under data_dir, prepared on first use."""
    try:
        return TokenData(data_dir, "shakespeare-char")
    except FileNotFoundError:
        prepare_embedded(Path(data_dir) / "shakespeare-char")
        return TokenData(data_dir, "shakespeare-char")


class TokenData:
    """train/val memmaps of one prepared dataset."""

    def __init__(self, data_dir: str | Path, dataset: str):
        self.root = Path(data_dir) / dataset
        missing = [n for n in ("train.bin", "val.bin", "meta.json") if not (self.root / n).exists()]
        if missing:
            raise FileNotFoundError(
                f"data: {self.root} lacks {missing}; prepare it with: "
                f"stableflash prepare --dataset {dataset} --data-dir {data_dir}")
        self.meta = json.loads((self.root / "meta.json").read_text())
        self.splits = {s: np.memmap(self.root / f"{s}.bin", dtype=np.uint16, mode="r") for s in ("train", "val")}

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


def batch_offsets(seed: int, step: int, count: int, block_size: int, num_tokens: int, split: str = "train") -> np.ndarray:
    """The `count` sequence start offsets of `step`: a pure function of (seed, step, split)."""
    if num_tokens <= block_size + 1:
        raise ValueError(f"data: {num_tokens} tokens are too few for block_size {block_size}")
    salt = 0 if split == "train" else 1_000_003
    g = torch.Generator().manual_seed((seed * 1_000_000_007 + step * 2 + salt) % 2**63)
    return torch.randint(0, num_tokens - block_size - 1, (count,), generator=g).numpy()


def gather(tokens: np.memmap, offsets: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 tensors of shape (len(offsets), block_size) for next-token prediction."""
    rows = np.stack([np.asarray(tokens[o: o + block_size + 1], dtype=np.int64) for o in offsets])
    data = torch.from_numpy(rows)
    return data[:, :-1], data[:, 1:]


class ReplayLog:
    """Per-step batch offsets, appended as JSON lines to `batches.jsonl` in the run folder."""

    def __init__(self, path: Path):
        self.path = path
        self.recorded: dict[int, list[int]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.recorded[row["step"]] = row["offsets"]

    def record(self, step: int, offsets: np.ndarray) -> None:
        if step in self.recorded:
            return
        self.recorded[step] = [int(o) for o in offsets]
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "offsets": self.recorded[step]}) + "\n")

    def check_covers(self, first: int, stop: int) -> None:
        """Raise before any work unless steps first..stop-1 are all recorded."""
        missing = [step for step in range(first, stop) if step not in self.recorded]
        if missing:
            raise ValueError(f"--replay: the replayed run recorded batches for steps {min(self.recorded)}.."
                             f"{max(self.recorded)}, this run needs steps {first}..{stop - 1} (missing from step "
                             f"{missing[0]}); lower run.max_steps to at most {missing[0]}")

    def offsets(self, step: int) -> np.ndarray:
        if step not in self.recorded:
            raise ValueError(f"--replay: the replayed run recorded no batch for step {step} "
                             f"(it has steps {min(self.recorded, default=None)}..{max(self.recorded, default=None)})")
        return np.asarray(self.recorded[step], dtype=np.int64)
