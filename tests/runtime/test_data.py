"""Deterministic data: step s's samples depend on (seed, s, B) only; each sample once per epoch;
replicas and micro-batches split the step by index, evenly or unevenly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipectl.errors import UserInputError
from pipectl.models import build_model
from pipectl.runtime.data import (
    ByteCorpus,
    DatasetSource,
    DeterministicBatches,
    SyntheticSource,
    TextFileSource,
    TokenFileSource,
    check_dataset,
    corpus_bytes,
    make_source,
    replica_slices,
    step_sample_indices,
)


@settings(max_examples=40, deadline=None)
@given(
    num_samples=st.integers(1, 60),
    global_batch=st.integers(1, 25),
    seed=st.integers(0, 1000),
    epochs=st.integers(1, 3),
)
def test_every_sample_is_seen_exactly_once_per_epoch(num_samples, global_batch, seed, epochs):
    steps = -(-epochs * num_samples // global_batch)
    stream = np.concatenate([step_sample_indices(s, global_batch, num_samples, seed) for s in range(steps)])
    for epoch in range(epochs):
        assert sorted(stream[epoch * num_samples : (epoch + 1) * num_samples]) == list(range(num_samples))


def test_a_step_depends_on_seed_step_and_batch_only():
    a = step_sample_indices(5, 8, 1000, seed=3)
    assert np.array_equal(a, step_sample_indices(5, 8, 1000, seed=3))
    assert not np.array_equal(a, step_sample_indices(5, 8, 1000, seed=4))
    assert not np.array_equal(a, step_sample_indices(6, 8, 1000, seed=3))
    # Epochs are shuffled differently.
    assert not np.array_equal(step_sample_indices(0, 10, 10, 3), step_sample_indices(1, 10, 10, 3))


@pytest.mark.parametrize("data_parallel,b,m", [(1, 8, 1), (1, 2, 4), (2, 2, 2), (4, 1, 2), (8, 1, 1)])
def test_any_split_of_a_step_reassembles_the_same_global_batch(data_parallel, b, m):
    model = build_model("gpt-tiny")
    batches = DeterministicBatches(ByteCorpus(model.seq_len, model.vocab), global_batch=8, seed=11)
    whole_inputs, whole_labels = batches.global_batch_tensors(step=3)
    parts = [
        mb
        for replica in replica_slices(8, data_parallel, b, m)
        for mb in batches.micro_batches(3, replica)
    ]
    assert all(x.shape == (b, model.seq_len) for x, _ in parts)
    assert torch.equal(torch.cat([x for x, _ in parts]), whole_inputs)
    assert torch.equal(torch.cat([y for _, y in parts]), whole_labels)


def test_uneven_replicas_take_contiguous_slices_of_their_size():
    slices = replica_slices(12, 2, 0, 0, uneven=[(4, 2), (2, 2)])
    assert [(s.start, s.samples) for s in slices] == [(0, 8), (8, 4)]
    batches = DeterministicBatches(SyntheticSource(build_model("mlp-tiny"), seed=1), global_batch=12, seed=1)
    indices = batches.step_indices(0)
    inputs = [x for s in slices for x, _ in batches.micro_batches(0, s)]
    assert [len(x) for x in inputs] == [4, 4, 2, 2]
    assert torch.equal(torch.cat(inputs), batches.source.batch(indices.tolist())[0])


def test_replica_shares_must_cover_the_global_batch():
    with pytest.raises(UserInputError, match="cover 10 samples.*not the global batch 12"):
        replica_slices(12, 2, 0, 0, uneven=[(4, 2), (2, 1)])
    with pytest.raises(UserInputError, match="3 replica shares given for data-parallel degree 2"):
        replica_slices(12, 2, 0, 0, uneven=[(4, 1), (4, 1), (4, 1)])


def test_byte_corpus_windows_are_shifted_by_one_byte():
    corpus = ByteCorpus(seq_len=32)
    raw = corpus_bytes()
    assert corpus.num_samples == (len(raw) - 1) // 32 > 5000
    inputs, labels = corpus.batch([0, 7])
    assert bytes(inputs[1].tolist()) == raw[7 * 32 : 8 * 32]
    assert bytes(labels[1].tolist()) == raw[7 * 32 + 1 : 8 * 32 + 1]
    assert inputs.dtype == torch.int64
    with pytest.raises(UserInputError, match="vocabulary of 256, the model has 100"):
        ByteCorpus(seq_len=32, vocab=100)


def test_synthetic_samples_depend_on_their_index_only():
    source = SyntheticSource(build_model("gpt-tiny"), seed=5)
    a = source.batch([3, 9])
    b = source.batch([9])
    assert torch.equal(a[0][1], b[0][0]) and torch.equal(a[1][1], b[1][0])
    assert not torch.equal(a[0][0], a[0][1])


def test_token_files_npy_and_bin(tmp_path):
    tokens = (np.arange(1000) % 250).astype(np.uint16)
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    tokens.tofile(tmp_path / "t.bin")
    tokens.astype(np.int32).tofile(tmp_path / "t32.bin")
    sources = [
        TokenFileSource(tmp_path / "t.npy", seq_len=10, vocab=256),
        TokenFileSource(tmp_path / "t.bin", seq_len=10, vocab=256),
        TokenFileSource(tmp_path / "t32.bin", seq_len=10, vocab=256, bin_dtype="int32"),
    ]
    for source in sources:
        assert source.num_samples == 99
        inputs, labels = source.batch([2])
        assert inputs[0].tolist() == list(range(20, 30)) and labels[0].tolist() == list(range(21, 31))
    assert sources[0].fingerprint == sources[2].fingerprint != sources[1].fingerprint


def test_bad_token_files_are_user_errors(tmp_path):
    np.save(tmp_path / "big.npy", np.array([1, 2, 300] * 20, dtype=np.int32))
    with pytest.raises(UserInputError, match=r"token ids span \[1, 300\], outside the vocabulary 0..255"):
        TokenFileSource(tmp_path / "big.npy", seq_len=4, vocab=256)
    with pytest.raises(UserInputError, match="token file not found"):
        TokenFileSource(tmp_path / "missing.npy", seq_len=4, vocab=256)
    (tmp_path / "zeros.npy").write_bytes(bytes(4096))  # not pickled data: no array at all
    with pytest.raises(UserInputError, match="zeros.npy is not a .npy array: it does not start with NumPy's header"):
        TokenFileSource(tmp_path / "zeros.npy", seq_len=4, vocab=256)
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(UserInputError, match=r"must end in .npy or .bin"):
        TokenFileSource(tmp_path / "t.txt", seq_len=4, vocab=256)
    np.save(tmp_path / "short.npy", np.array([1, 2], dtype=np.int32))
    with pytest.raises(UserInputError, match="fewer than one sample of 5"):
        TokenFileSource(tmp_path / "short.npy", seq_len=4, vocab=256)


def test_make_source_picks_by_model_and_request(tmp_path):
    gpt, mlp = build_model("gpt-tiny"), build_model("mlp-tiny")
    assert isinstance(make_source(gpt, None, 0), ByteCorpus)
    assert isinstance(make_source(gpt, "synthetic", 0), SyntheticSource)
    assert isinstance(make_source(mlp, None, 0), SyntheticSource)
    with pytest.raises(UserInputError, match="not a language model"):
        make_source(mlp, "corpus", 0)
    with pytest.raises(UserInputError, match="not a language model: text file notes.txt") as refused:
        make_source(mlp, "notes.txt", 0)
    assert "synthetic" in refused.value.hint and "package.module:function" in refused.value.hint


# --------------------------------------------------------------------------- text files, datasets

DATASET_MODULE = '''
import torch


class Squares:
    """Sample i: inputs [i, i], label i * i (a regression toy)."""

    def __len__(self):
        return 20

    def __getitem__(self, index):
        return torch.tensor([float(index), float(index)]), torch.tensor(float(index * index))


class Pairs(Squares):
    def collate(self, samples):
        return torch.stack([x for x, _ in samples]) * 10, torch.stack([y for _, y in samples])


class Empty:
    def __len__(self):
        return 0

    def __getitem__(self, index):
        raise IndexError(index)


def squares():
    return Squares()


def pairs():
    return Pairs()


def empty():
    return Empty()


def numbers():
    return [1, 2, 3]


class Raising(Squares):
    def __getitem__(self, index):
        raise KeyError(f"boom {index}")


def raising():
    return Raising()


def failing():
    raise RuntimeError("no data here")
'''


@pytest.fixture
def dataset_module(tmp_path, monkeypatch):
    (tmp_path / "user_data.py").write_text(DATASET_MODULE)
    monkeypatch.setenv("PIPECTL_MODEL_PATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_data"


def test_a_text_file_is_bytes_for_a_model_without_tokenizer(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("héllo wörld, " * 40, encoding="utf-8")
    model = build_model("gpt-tiny")
    source = make_source(model, str(text), seed=0)
    assert isinstance(source, TextFileSource)
    inputs, labels = source.batch([0, 1])
    raw = np.frombuffer(text.read_bytes(), dtype=np.uint8)
    assert inputs[0].tolist() == raw[: model.seq_len].tolist() and labels[0].tolist() == raw[1 : model.seq_len + 1].tolist()


def test_a_text_file_is_tokenized_with_the_models_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = "the quick brown fox jumps over the lazy dog".split()
    vocabulary = {w: i for i, w in enumerate(dict.fromkeys(words))}  # the 0 ... dog 7
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="dog"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(words * 30))
    source = TextFileSource(text, seq_len=8, vocab=len(vocabulary), tokenizer=str(tmp_path / "tokenizer.json"))
    inputs, labels = source.batch([0])
    assert inputs[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 6] and labels[0].tolist() == [1, 2, 3, 4, 5, 0, 6, 7]
    with pytest.raises(UserInputError, match=r"token ids span \[0, 7\], outside the vocabulary 0..3"):
        TextFileSource(text, seq_len=8, vocab=4, tokenizer=str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserInputError, match="no tokenizer and a vocabulary of 8, too small for bytes"):
        TextFileSource(text, seq_len=8, vocab=8)


def test_a_dataset_function_gives_its_samples_in_pipectls_order(dataset_module):
    source = make_source(build_model("mlp-tiny"), f"dataset:{dataset_module}:squares", seed=0)
    assert source.num_samples == 20 and source.fingerprint == f"dataset:{dataset_module}:squares:20"
    inputs, labels = source.batch([3, 1])
    assert inputs.tolist() == [[3.0, 3.0], [1.0, 1.0]] and labels.tolist() == [9.0, 1.0]
    batches = DeterministicBatches(source, global_batch=8, seed=4)
    _, step_labels = batches.global_batch_tensors(2)
    assert step_labels.tolist() == [float(i * i) for i in step_sample_indices(2, 8, 20, 4)]
    own = DatasetSource(f"{dataset_module}:pairs")
    assert own.batch([2])[0].tolist() == [[20.0, 20.0]]  # the dataset's own collate
    assert check_dataset(f"{dataset_module}:squares") == 20


@pytest.mark.parametrize(
    "function, message",
    [("empty", "is empty"), ("numbers", "samples must be \\(inputs, labels\\) pairs"), ("missing", "cannot load dataset factory"),
     ("raising", "its first sample raised KeyError: 'boom 0'"), ("failing", "raised RuntimeError: no data here")],
)
def test_bad_datasets_are_named(dataset_module, function, message):
    with pytest.raises(UserInputError, match=message):
        check_dataset(f"{dataset_module}:{function}")


def test_data_specs_name_what_ranks_read(tmp_path, dataset_module):
    from pipectl.artifacts.run import DataKind, DataSpec
    from pipectl.launch.options import parse_data

    text = tmp_path / "corpus.txt"
    text.write_text("x")
    assert parse_data(str(text)) == DataSpec(kind=DataKind.FILE, path=str(text.resolve()))
    spec = parse_data(f"{dataset_module}:squares")
    assert spec.kind is DataKind.DATASET and spec.source() == f"dataset:{dataset_module}:squares"
    assert parse_data("builtin").source() is None  # the byte corpus for a language model, synthetic otherwise
    with pytest.raises(ValueError, match="neither 'builtin', 'synthetic', an existing file nor a dataset"):
        parse_data("nonsense")
    with pytest.raises(ValueError, match="^no such data file$"):  # a file's name: said as missing
        parse_data("no/such/file.txt")
    with pytest.raises(ValueError, match="^a directory, not a data file$"):
        parse_data(str(tmp_path))


def test_the_example_dataset_fits_mlp_tiny(monkeypatch):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PIPECTL_MODEL_PATH", str(root))
    monkeypatch.syspath_prepend(str(root))
    assert check_dataset("examples.dataset:build") == 4096
    inputs, labels = DatasetSource("examples.dataset:build").batch([0, 11])
    assert inputs.shape == (2, 784) and labels.tolist() == [0, 1]
