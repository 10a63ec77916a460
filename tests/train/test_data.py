import numpy as np
import pytest

from stableflash.train.data import TokenData, batch_offsets, gather
from stableflash.train.prepare import prepare_documents


def test_document_pipeline_on_a_local_stand_in(tmp_path):
    # the OpenWebText path (documents -> tokens + end-of-text -> memmaps) on a stand-in corpus and tokenizer
    docs = [f"document {i}: " + "lorem ipsum " * (i + 1) for i in range(50)]
    eot = 256
    meta = prepare_documents(iter(docs), tmp_path / "standin", lambda t: list(t.encode()) + [eot], vocab_size=257,
                             name="standin", val_fraction=0.1)
    data = TokenData(tmp_path, "standin")
    tokens = np.concatenate([data.splits["train"], data.splits["val"]])
    expected = np.concatenate([np.array(list(d.encode()) + [eot]) for d in docs])
    assert np.array_equal(tokens, expected) and data.vocab_size == 257
    assert meta["train_tokens"] + meta["val_tokens"] == expected.size
    x, y = gather(data.splits["train"], batch_offsets(0, 3, 4, 16, len(data.splits["train"])), 16)
    assert x.shape == (4, 16) and np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
    with pytest.raises(ValueError, match="does not fit uint16"):
        prepare_documents([], tmp_path / "big", lambda t: [], vocab_size=70000, name="big")


def test_batches_are_a_pure_function_of_seed_and_step():
    a = batch_offsets(1, 5, 8, 64, 10_000)
    assert np.array_equal(a, batch_offsets(1, 5, 8, 64, 10_000))
    assert not np.array_equal(a, batch_offsets(1, 6, 8, 64, 10_000))
    assert not np.array_equal(a, batch_offsets(2, 5, 8, 64, 10_000))


def test_debian_docs_corpus_on_a_small_slice(tmp_path):
    """The corpus builder's own code on a few files of each kind the packages ship (HTML, reST, POD, man)."""
    import gzip

    pytest.importorskip("tokenizers")
    from stableflash.train.corpus import EOT, documents, prepare_corpus, text_of
    from stableflash.train.data import TokenData

    root = tmp_path / "pkg"
    (root / "html").mkdir(parents=True)
    words = "The quick brown fox jumps over the lazy dog while the attention heads count their ties. " * 8
    (root / "html" / "a.html").write_text(f"<html><head><title>x</title><script>var no;</script></head>"
                                          f"<body><nav>menu</nav><p>{words}</p></body></html>")
    (root / "html" / "print.html").write_text(f"<p>{words}</p>")  # a whole-book repeat: left out
    (root / "b.rst.txt").write_text(f"Title\n=====\n\n{words}\n")
    (root / "c.pod").write_text(f"=head1 NAME\n\n{words}\n")
    (root / "d.2.gz").write_bytes(gzip.compress(f'.TH D 2\n.\\" a comment\n.SH NAME\n\\fBd\\fP \\- {words}\n'.encode()))
    assert "menu" not in text_of(root / "html" / "a.html") and "var no" not in text_of(root / "html" / "a.html")
    assert "comment" not in text_of(root / "d.2.gz") and text_of(root / "d.2.gz").startswith("NAME\nd - The quick")
    docs = list(documents(root, ("html/*.html", "*.rst.txt", "*.pod", "*.gz")))
    assert len(docs) == 4
    meta = prepare_corpus(docs * 5, tmp_path / "out", vocab_size=300, name="slice", val_fraction=0.1)
    data = TokenData(tmp_path, "out")
    tokens = np.concatenate([np.asarray(data.splits[s]) for s in ("train", "val")])
    assert data.vocab_size == meta["vocab_size"] <= 300
    assert (tokens == meta["eot"]).sum() == 20  # one end-of-text after each document
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    first = tokens[: int(np.argmax(tokens == meta["eot"]))]
    assert tokenizer.decode(first.tolist()) == docs[0] and tokenizer.token_to_id(EOT) == meta["eot"]


def test_runs_that_start_together_can_all_prepare_the_embedded_corpus(tmp_path):
    """Several runs starting at once in a fresh folder (the study scripts' parallel arms) each prepare the embedded
    corpus; none may fail on another's temporary file, and all read the same tokens."""
    import threading

    from stableflash.train.data import ensure_embedded

    results, errors = [], []

    def prepare():
        try:
            results.append(ensure_embedded(tmp_path / "data").vocab_size)
        except Exception as error:  # noqa: BLE001 - the test reports any failure
            errors.append(error)

    threads = [threading.Thread(target=prepare) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [256] * 4
    assert sorted(p.name for p in (tmp_path / "data" / "shakespeare-char").iterdir()) == ["meta.json", "train.bin",
                                                                                         "val.bin"]
