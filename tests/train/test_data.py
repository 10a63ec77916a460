import numpy as np
import pytest

from stableflash.train.data import TokenData, batch_offsets, gather, prepare_documents


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
