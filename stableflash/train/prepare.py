"""`stableflash prepare`: token memmaps of a dataset (the embedded corpus, Debian's manuals, OpenWebText)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from stableflash.train.corpus import prepare_debian_docs
from stableflash.train.data import DATASETS, prepare_embedded, write_memmaps


def gpt2_encoder() -> Callable[[str], list[int]]:
    """tiktoken's GPT-2 BPE, with the end-of-text token appended per document."""
    try:
        import tiktoken
    except ImportError:
        raise ImportError("GPT-2 BPE needs the `tiktoken` package; install the data extra: "
                          "pip install 'stableflash[data]'") from None

    enc = tiktoken.get_encoding("gpt2")
    return lambda text: enc.encode_ordinary(text) + [enc.eot_token]


def prepare_documents(documents: Iterable[str], out_dir: Path, encode: Callable[[str], list[int]],
                      vocab_size: int, name: str, val_fraction: float = 0.0005) -> dict:
    """Tokenize an iterable of documents into memmaps (the OpenWebText path, on any text source)."""
    if vocab_size > 65536:
        raise ValueError(f"vocab_size: {vocab_size} does not fit uint16 memmaps")
    chunks = (np.asarray(encode(doc), dtype=np.uint16) for doc in documents)
    return write_memmaps(chunks, out_dir, val_fraction, {"dataset": name, "tokenizer": "gpt2", "vocab_size": vocab_size})


def prepare_openwebtext(out_dir: Path, num_docs: int | None = None) -> dict:
    """OpenWebText through `datasets`, GPT-2 BPE through `tiktoken` (needs the network)."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise ImportError("prepare --dataset openwebtext: needs the `datasets` package; install the data extra: "
                          "pip install 'stableflash[data]'") from None
    split = "train" if num_docs is None else f"train[:{num_docs}]"
    docs = (row["text"] for row in load_dataset("openwebtext", split=split))
    return prepare_documents(docs, out_dir, gpt2_encoder(), vocab_size=50257, name="openwebtext")


def prepare(dataset: str, data_dir: Path, num_docs: int | None = None) -> dict:
    out_dir = Path(data_dir) / dataset
    if dataset == "shakespeare-char":
        return prepare_embedded(out_dir)
    if dataset == "openwebtext":
        return prepare_openwebtext(out_dir, num_docs)
    if dataset == "debian-docs":
        return prepare_debian_docs(out_dir)
    raise ValueError(f"dataset: expected one of {DATASETS}, got {dataset!r}")


def add_prepare_arguments(parser) -> None:
    parser.add_argument("--dataset", default="shakespeare-char", choices=DATASETS)
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--num-docs", type=int, default=None, help="openwebtext: only the first N documents")


def prepare_command(args) -> int:
    meta = prepare(args.dataset, Path(args.data_dir), args.num_docs)
    print(json.dumps(meta, indent=2))
    return 0
