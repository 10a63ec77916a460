"""A natural-English corpus a fresh Debian machine can build: the documentation Debian packages ship.

`stableflash prepare --dataset debian-docs` downloads the packages below with `apt-get download` (the only thing
it needs from outside), takes their prose (reStructuredText sources, POD, AsciiDoc, HTML pages as text), one
document per file with an end-of-text token between documents, trains a byte-level BPE vocabulary on it with
`tokenizers` and writes `train.bin` / `val.bin` (uint16) with `tokenizer.json` and `meta.json`: the Python,
Linux kernel, Perl, Git, PostgreSQL and Rust manuals and the Debian Administrator's Handbook. Licenses: each
package's `copyright` file is kept in `licenses.json` (PSF, GPL-2, GPL/Artistic, PostgreSQL, MIT/Apache-2.0,
GPL-2+/CC-BY-SA-3.0: all free to redistribute).
"""

from __future__ import annotations

import gzip
import html.parser
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from stableflash.train.data import write_memmaps

EOT = "<|endoftext|>"
# package -> the glob patterns of its prose inside the package
DEBIAN_DOCS = {
    "python3.11-doc": ("usr/share/doc/python3.11/html/_sources/**/*.rst.txt",),
    "linux-doc-6.1": ("usr/share/doc/linux-doc-6.1/html/_sources/**/*.rst.txt",),
    "perl-doc": ("usr/share/perl/*/pod/*.pod",),
    "git-doc": ("usr/share/doc/git-doc/*.txt",),
    "postgresql-doc-15": ("usr/share/doc/postgresql-doc-15/html/*.html",),
    "debian-handbook": ("usr/share/doc/debian-handbook/html/en-US/*.html",),
    "rust-doc": tuple(f"usr/share/doc/rust-doc/html/{book}/**/*.html"
                      for book in ("book", "reference", "nomicon", "embedded-book", "rust-by-example", "rustc")),
    "python-django-doc": ("usr/share/doc/python-django-doc/html/**/*.html",),
    "manpages": ("usr/share/man/man*/*.gz",),
    "manpages-dev": ("usr/share/man/man*/*.gz",),
}
REPEATS = {"print.html", "toc.html", "searchindex.html", "404.html", "genindex.html", "py-modindex.html",
           "search.html"}
"""Pages that only repeat or index the others (mdBook's whole-book print page)."""


class _Text(html.parser.HTMLParser):
    """An HTML page's text, without its scripts, styles and navigation."""

    SKIP = {"script", "style", "nav", "head"}

    def __init__(self):
        super().__init__()
        self.parts, self.depth = [], 0

    def handle_starttag(self, tag, attrs):
        self.depth += tag in self.SKIP
        if tag in ("p", "div", "li", "tr", "h1", "h2", "h3", "pre", "br"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        self.depth -= tag in self.SKIP and self.depth > 0

    def handle_data(self, data):
        if not self.depth:
            self.parts.append(data)


_ROFF_TEXT = {".SH", ".SS", ".B", ".I", ".BR", ".IR", ".RB", ".BI", ".IB", ".RI", ".IP", ".TP"}
_ROFF_ESCAPES = re.compile(r"\\f(\[[^]]*\]|\(..|.)|\\\(..|\\\[[^]]*\]|\\\*(\(..|.)|\\[&|^%]")


def _roff_text(raw: str) -> str:
    """A man page's words: text lines, and the arguments of the macros that carry text; escapes dropped."""
    lines = []
    for line in raw.splitlines():
        if line.startswith(("'", '.\\"')):
            continue
        if line.startswith("."):
            macro, _, rest = line.partition(" ")
            if macro not in _ROFF_TEXT:
                continue
            line = rest.replace('"', "")
        lines.append(_ROFF_ESCAPES.sub("", line).replace("\\-", "-").replace("\\e", "\\"))
    return "\n".join(lines)


def text_of(path: Path) -> str:
    """A file's prose: HTML and man pages as text, the rest as it is; runs of blank lines and spaces squeezed."""
    if path.suffix == ".gz":  # man pages
        raw = _roff_text(gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace"))
    else:
        raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".html":
        parser = _Text()
        parser.feed(raw)
        raw = "".join(parser.parts)
    raw = re.sub(r"[ \t]+", " ", raw)
    return re.sub(r"\n\s*\n+", "\n\n", raw).strip()


def documents(root: Path, patterns: Iterable[str], min_chars: int = 200) -> Iterator[str]:
    """The documents under `root` matching `patterns`, in sorted order (the corpus is the same on any machine)."""
    for pattern in patterns:
        for path in sorted(root.glob(pattern)):
            if path.is_file() and path.name not in REPEATS:
                text = text_of(path)
                if len(text) >= min_chars:
                    yield text


def train_tokenizer(docs: list[str], vocab_size: int):
    """A byte-level BPE vocabulary with `EOT` as its one special token."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ImportError("prepare --dataset debian-docs: needs the `tokenizers` package; install the data extra: "
                          "pip install 'stableflash[data]'") from None

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer=trainer)
    return tokenizer


def prepare_corpus(docs: list[str], out_dir: Path, *, vocab_size: int = 8192, name: str, meta: dict | None = None,
                   val_fraction: float = 0.01) -> dict:
    """Tokenize `docs` (EOT after each) with a BPE trained on them; write the memmaps, tokenizer and meta."""
    if not docs:
        raise ValueError(f"{name}: no documents to prepare")
    if vocab_size > 65535:
        raise ValueError(f"vocab_size: at most 65535 (tokens are stored as uint16), got {vocab_size}")
    tokenizer = train_tokenizer(docs, vocab_size)
    eot = tokenizer.token_to_id(EOT)
    chunks = [np.asarray(encoding.ids + [eot], dtype=np.uint16) for encoding in tokenizer.encode_batch(docs)]
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return write_memmaps(chunks, out_dir, val_fraction,
                         {"dataset": name, "tokenizer": "tokenizer.json (byte-level BPE)",
                          "vocab_size": tokenizer.get_vocab_size(), "eot": eot, "documents": len(docs), **(meta or {})})


def _apt_download(package: str, into: Path) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise FileNotFoundError("prepare --dataset debian-docs: needs apt-get and dpkg-deb (a Debian machine)")
    done = subprocess.run(["apt-get", "download", package], cwd=into, capture_output=True, text=True)
    debs = sorted(into.glob(f"{package}_*.deb"))
    if done.returncode != 0 or not debs:
        raise FileNotFoundError(f"prepare --dataset debian-docs: apt-get download {package} failed "
                                f"({done.stderr.strip()[-300:]}); run 'apt-get update' first")
    return debs[-1]


def prepare_debian_docs(out_dir: Path, packages: dict[str, tuple[str, ...]] = DEBIAN_DOCS,
                        vocab_size: int = 8192) -> dict:
    """Download the packages, take their prose and prepare it (see the module docstring)."""
    from tqdm import tqdm

    docs, sources, licenses = [], {}, {}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for package, patterns in tqdm(packages.items(), desc="debian-docs: download, extract", unit="package"):
            root = work / package
            root.mkdir()
            subprocess.run(["dpkg-deb", "-x", str(_apt_download(package, work)), str(root)], check=True)
            found = list(documents(root, patterns))
            sources[package] = len(found)
            docs += found
            copyright_file = next(iter(sorted(root.glob("usr/share/doc/*/copyright"))), None)
            licenses[package] = copyright_file.read_text(errors="replace")[:2000] if copyright_file else None
    print(f"debian-docs: {len(docs)} documents; training the BPE vocabulary and tokenizing (about a minute)",
          flush=True)
    meta = prepare_corpus(docs, out_dir, vocab_size=vocab_size, name="debian-docs",
                          meta={"sources": sources, "packages": list(packages)})
    (out_dir / "licenses.json").write_text(json.dumps(licenses, indent=1))
    return meta
