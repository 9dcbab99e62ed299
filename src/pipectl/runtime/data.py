"""Deterministic training data: the samples of step s depend on (seed, s, global batch) only.

Data order (docs/design.md, 'The global batch') is a function of the global step and B, so a step's batch is the same on any
hardware and across resizes, and each sample is seen once per epoch. VirtualFlow's virtual nodes
make this the whole convergence promise: the mapping of the batch onto devices is free to change.

The sample stream is epoch after epoch of a permutation of all sample indices, each epoch's
permutation seeded by (seed, epoch). Step s takes stream positions [s*B, (s+1)*B). Replica r of
the data-parallel group takes a contiguous slice of those B samples (uneven slices when a
heterogeneous plan gives replicas different sample counts), and cuts it into micro-batches in
order. Example, B = 8, d = 2, b = 2 (m = 2):

    step 0 stream positions 0..7 -> indices perm(seed, 0)[0:8] = [i0 .. i7]
    replica 0: micro-batch 0 = [i0, i1], micro-batch 1 = [i2, i3]
    replica 1: micro-batch 0 = [i4, i5], micro-batch 1 = [i6, i7]

Sources (all need no download):

- `ByteCorpus`: byte-level language modelling over a fixed list of Python standard-library source
  files (about 350 kB; the same bytes on every machine with the same Python version; `fingerprint`
  is their sha256 so a run can tell when a machine differs). Vocabulary 256.
- `SyntheticSource`: sample i is drawn from the model's own `make_batch` with a generator seeded by
  (seed, i): any model, any size, no file.
- `TokenFileSource`: a user token file, `.npy` (1-D integer array) or raw `.bin` (uint16 by
  default, nanoGPT's format; int32 on request), cut into windows of seq_len + 1 tokens.
- `TextFileSource`: a user text file (`.txt`, `.text` or `.md`, UTF-8), tokenized once per rank with the model's own
  tokenizer (a Hugging Face model's tokenizer.json, through the `tokenizers` library), or as bytes
  when the model has none (vocabulary of at least 256), then cut into windows as above.
- `DatasetSource`: a user dataset `package.module:function` (code, like a model factory): the
  function returns an object with `__len__` and `__getitem__(index) -> sample`; samples are
  `(inputs, labels)` pairs of tensors stacked into a batch, or whatever the object's own
  `collate(samples) -> (inputs, labels)` makes of them. The order is pipectl's (indices by step),
  never the dataset's.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from pipectl.artifacts.run import SEED_STRIDE
from pipectl.errors import UserInputError
from pipectl.models.base import ModelLayers

# Stable, mid-sized standard-library modules (pure Python, present in every CPython 3.10+).
CORPUS_MODULES = (
    "textwrap.py",
    "heapq.py",
    "fractions.py",
    "string.py",
    "difflib.py",
    "shlex.py",
    "calendar.py",
    "statistics.py",
    "random.py",
    "functools.py",
    "pprint.py",
)

MicroBatch = tuple[torch.Tensor, torch.Tensor]


class SampleSource(Protocol):
    """A finite, indexable set of training samples."""

    @property
    def num_samples(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def batch(self, indices: Sequence[int]) -> MicroBatch: ...


def _windows(tokens: np.ndarray, seq_len: int, indices: Sequence[int]) -> MicroBatch:
    """Sample i = tokens[i*seq_len : i*seq_len + seq_len + 1]; inputs/labels shifted by one."""
    rows = np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in indices]).astype(np.int64)
    rows_tensor = torch.from_numpy(rows)
    return rows_tensor[:, :-1].contiguous(), rows_tensor[:, 1:].contiguous()


class TokenArraySource:
    """Language-model windows of seq_len + 1 tokens over a 1-D token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab: int, name: str) -> None:
        if tokens.ndim != 1:
            raise UserInputError(f"{name}: tokens must be a 1-D array, got shape {tokens.shape}")
        if len(tokens) < seq_len + 1:
            raise UserInputError(f"{name}: {len(tokens)} tokens are fewer than one sample of {seq_len + 1}")
        largest = int(tokens.max())
        if largest >= vocab or int(tokens.min()) < 0:
            raise UserInputError(f"{name}: token ids span [{int(tokens.min())}, {largest}], outside the vocabulary 0..{vocab - 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.name = name
        self._fingerprint = hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()

    @property
    def num_samples(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def batch(self, indices: Sequence[int]) -> MicroBatch:
        return _windows(self.tokens, self.seq_len, indices)


def corpus_bytes() -> bytes:
    """The built-in corpus: the CORPUS_MODULES sources, concatenated in order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return b"".join((stdlib / name).read_bytes() for name in CORPUS_MODULES)


class ByteCorpus(TokenArraySource):
    """Byte-level LM over the built-in corpus (vocabulary 256)."""

    def __init__(self, seq_len: int, vocab: int = 256) -> None:
        if vocab < 256:
            raise UserInputError(f"the byte corpus needs a vocabulary of 256, the model has {vocab}")
        tokens = np.frombuffer(corpus_bytes(), dtype=np.uint8)
        super().__init__(tokens, seq_len, vocab, name="byte corpus")


NPY_MAGIC = b"\x93NUMPY"  # the first bytes of every .npy file (NumPy's format.MAGIC_PREFIX)


class TokenFileSource(TokenArraySource):
    """A user token file: `.npy` (any integer dtype) or raw `.bin` (uint16, or int32)."""

    def __init__(self, path: str | Path, seq_len: int, vocab: int, bin_dtype: str = "uint16") -> None:
        path = Path(path)
        if not path.is_file():
            raise UserInputError(f"token file not found: {path}")
        if path.suffix == ".npy":
            with path.open("rb") as handle:
                magic = handle.read(len(NPY_MAGIC))
            if magic != NPY_MAGIC:  # else NumPy takes it for a pickle and says so
                raise UserInputError(f"{path} is not a .npy array: it does not start with NumPy's header")
            try:
                tokens = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:
                raise UserInputError(f"{path} is not a plain .npy array: {exc}") from exc
        elif path.suffix == ".bin":
            if bin_dtype not in ("uint16", "int32"):
                raise UserInputError(f"token .bin dtype must be uint16 or int32, got {bin_dtype!r}")
            size = path.stat().st_size
            width = np.dtype(bin_dtype).itemsize
            if size == 0:
                raise UserInputError(f"{path} is empty: no tokens to train on")
            if size % width:
                raise UserInputError(
                    f"{path} holds {size} bytes, not a whole number of {bin_dtype} tokens ({width} bytes each)"
                )
            try:
                tokens = np.memmap(path, dtype=np.dtype(bin_dtype), mode="r")
            except (ValueError, OSError) as exc:
                raise UserInputError(f"{path} cannot be read as {bin_dtype} tokens: {exc}") from exc
        else:
            raise UserInputError(f"data file {path} must end in .npy or .bin (tokens) or .txt, .text, .md (text)")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise UserInputError(f"{path} holds {tokens.dtype} values, expected integer token ids")
        super().__init__(np.asarray(tokens), seq_len, vocab, name=str(path))


TEXT_SUFFIXES = (".txt", ".text", ".md")


class TextFileSource(TokenArraySource):
    """A user text file tokenized with `tokenizer` (a tokenizer.json path) or as UTF-8 bytes."""

    def __init__(self, path: str | Path, seq_len: int, vocab: int, tokenizer: str | None = None) -> None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserInputError(f"text file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserInputError(f"{path} cannot be read as UTF-8 text: {exc}") from None
        if tokenizer is None:
            if vocab < 256:
                raise UserInputError(
                    f"{path}: the model has no tokenizer and a vocabulary of {vocab}, too small for bytes (256)",
                    hint="give a token file (.npy or .bin) made with the model's tokenizer",
                )
            tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            name = f"{path} (bytes)"
        else:
            from tokenizers import Tokenizer  # with transformers (pipectl[hf])

            try:
                ids = Tokenizer.from_file(tokenizer).encode(text, add_special_tokens=False).ids
            except Exception as exc:  # the library raises bare Exceptions for bad files
                raise UserInputError(f"cannot tokenize {path} with {tokenizer}: {exc}") from None
            tokens = np.asarray(ids, dtype=np.int64)
            name = f"{path} (tokenized with {tokenizer})"
        super().__init__(tokens, seq_len, vocab, name=name)


def _stack(samples: list) -> MicroBatch:
    """The default collate: samples are (inputs, labels) pairs of tensors, stacked."""
    try:
        inputs, labels = zip(*samples)
        return torch.stack(list(inputs)), torch.stack(list(labels))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UserInputError(
            f"dataset samples must be (inputs, labels) pairs of same-shaped tensors, or the dataset must define "
            f"collate(samples) -> (inputs, labels): {exc}"
        ) from None


class DatasetSource:
    """A user dataset `package.module:function` (see the module docstring)."""

    def __init__(self, reference: str) -> None:
        from pipectl.models.registry import call_factory, import_factory

        _, factory = import_factory(reference, what="dataset")
        dataset = call_factory(factory, reference, "dataset")
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise UserInputError(
                f"dataset '{reference}' returned {type(dataset).__name__}, which has no __len__ and __getitem__"
            )
        try:
            size = len(dataset)
        except Exception as exc:  # the user's __len__
            raise UserInputError(f"dataset '{reference}': len() raised {type(exc).__name__}: {exc}") from None
        if size < 1:
            raise UserInputError(f"dataset '{reference}' is empty")
        self.dataset = dataset
        self.reference = reference
        self.collate = getattr(dataset, "collate", _stack)
        self._num_samples = int(size)

    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def fingerprint(self) -> str:
        return f"dataset:{self.reference}:{self._num_samples}"

    def batch(self, indices: Sequence[int]) -> MicroBatch:
        inputs, labels = self.collate([self.dataset[int(i)] for i in indices])
        if not (torch.is_tensor(inputs) and torch.is_tensor(labels)):
            raise UserInputError(f"dataset '{self.reference}': a batch must be (inputs, labels) tensors")
        return inputs, labels


DATASET_PREFIX = "dataset:"  # make_source's `data` for a user dataset: dataset:package.module:function


def check_token_file(
    path: str | Path, seq_len: int | None, vocab: int | None, bin_dtype: str = "uint16", tokenizer: str | None = None
) -> int:
    """Read a token or text file as every rank will, before any rank starts: its format, dtype and
    shape, its ids inside the vocabulary, at least one sample of seq_len + 1 tokens. Returns its
    samples.

    `seq_len` and `vocab` are the model's (a plan's `model_shape`), `tokenizer` its tokenizer.json
    if it has one; a model without them is not a language model, and no token file fits it.
    """
    if seq_len is None or vocab is None:
        raise UserInputError(f"the model is not a language model: {_file_kind(path)} {path} does not fit it", hint=NOT_LM_HINT)
    if Path(path).suffix in TEXT_SUFFIXES:
        return TextFileSource(path, seq_len, vocab, tokenizer=tokenizer).num_samples
    return TokenFileSource(path, seq_len, vocab, bin_dtype=bin_dtype).num_samples


NOT_LM_HINT = "give --data a dataset function (package.module:function), or synthetic: the model's own make_batch"


def _file_kind(path: str | Path) -> str:
    return "text file" if Path(path).suffix in TEXT_SUFFIXES else "token file"


def check_dataset(reference: str) -> int:
    """Import the dataset and collate its first sample as every rank will, before any rank starts
    (its code runs here too). Returns its samples."""
    source = DatasetSource(reference)
    try:
        source.batch([0])
    except UserInputError:
        raise
    except Exception as exc:  # the user's __getitem__ or collate
        raise UserInputError(f"dataset '{reference}': its first sample raised {type(exc).__name__}: {exc}") from None
    return source.num_samples


class SyntheticSource:
    """Sample i comes from the model's `make_batch(1, generator)` seeded by (seed, i)."""

    def __init__(self, model: ModelLayers, seed: int, num_samples: int = 1 << 20) -> None:
        self.model = model
        self.seed = int(seed)
        self._num_samples = int(num_samples)

    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def fingerprint(self) -> str:
        return f"synthetic:{self.model.name}:{self.seed}:{self._num_samples}"

    def batch(self, indices: Sequence[int]) -> MicroBatch:
        inputs, labels = [], []
        for index in indices:
            generator = torch.Generator().manual_seed(self.seed * SEED_STRIDE + int(index))
            x, y = self.model.make_batch(1, generator)
            inputs.append(x)
            labels.append(y)
        return torch.cat(inputs), torch.cat(labels)


def make_source(model: ModelLayers, data: str | None, seed: int, bin_dtype: str = "uint16") -> SampleSource:
    """`None` or "corpus": the byte corpus (language models), else synthetic; "synthetic";
    "dataset:package.module:function"; or a path (a token file, or a text file)."""
    if data == "synthetic":
        return SyntheticSource(model, seed)
    if data is not None and data.startswith(DATASET_PREFIX):
        return DatasetSource(data[len(DATASET_PREFIX) :])
    if data in (None, "corpus"):
        if model.seq_len is None or model.vocab is None:
            if data == "corpus":
                raise UserInputError(f"model {model.name} is not a language model: the byte corpus does not fit it")
            return SyntheticSource(model, seed)
        return ByteCorpus(model.seq_len, model.vocab)
    if model.seq_len is None or model.vocab is None:
        raise UserInputError(
            f"model {model.name} is not a language model: {_file_kind(data)} {data} does not fit it", hint=NOT_LM_HINT
        )
    if Path(data).suffix in TEXT_SUFFIXES:
        return TextFileSource(data, model.seq_len, model.vocab, tokenizer=model.tokenizer)
    return TokenFileSource(data, model.seq_len, model.vocab, bin_dtype=bin_dtype)


@lru_cache(maxsize=4)
def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The order of all samples in one epoch; PCG64 seeded by (seed, epoch), stable across machines."""
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(num_samples)


def step_sample_indices(step: int, global_batch: int, num_samples: int, seed: int) -> np.ndarray:
    """The B sample indices of step `step`: stream positions [step*B, (step+1)*B).

    A step that crosses an epoch boundary takes the end of one epoch's permutation and the start
    of the next, so every sample is seen exactly once per epoch.

        >>> step_sample_indices(0, 4, 10, seed=1).tolist() == epoch_permutation(10, 1, 0)[:4].tolist()
        True
    """
    if step < 0 or global_batch <= 0:
        raise UserInputError(f"step must be >= 0 and the global batch > 0, got step {step}, batch {global_batch}")
    positions = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    epochs, offsets = np.divmod(positions, num_samples)
    indices = np.empty(global_batch, dtype=np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        indices[mask] = epoch_permutation(num_samples, seed, int(epoch))[offsets[mask]]
    return indices


@dataclass(frozen=True)
class ReplicaSlice:
    """The part of each step's global batch one data-parallel replica processes."""

    start: int  # offset in the step's B samples
    micro_batch_size: int
    micro_batches: int

    @property
    def samples(self) -> int:
        return self.micro_batch_size * self.micro_batches


def replica_slices(
    global_batch: int,
    data_parallel: int,
    micro_batch_size: int,
    micro_batches: int,
    uneven: Sequence[tuple[int, int]] | None = None,
) -> list[ReplicaSlice]:
    """Contiguous slices of the global batch, one per replica, in replica order.

    `uneven` (heterogeneous plans, `Candidate.replicas`) gives (micro_batch_size, micro_batches)
    per replica; otherwise every replica has b x m samples. The slices must cover B exactly.

        >>> [s.start for s in replica_slices(8, 2, 2, 2)]
        [0, 4]
        >>> [(s.start, s.samples) for s in replica_slices(10, 2, 1, 1, uneven=[(2, 3), (1, 4)])]
        [(0, 6), (6, 4)]
    """
    shapes = list(uneven) if uneven else [(micro_batch_size, micro_batches)] * data_parallel
    if len(shapes) != data_parallel:
        raise UserInputError(f"{len(shapes)} replica shares given for data-parallel degree {data_parallel}")
    slices, start = [], 0
    for b, m in shapes:
        slices.append(ReplicaSlice(start, b, m))
        start += b * m
    if start != global_batch:
        raise UserInputError(
            f"replicas cover {start} samples per step ({' + '.join(f'{b}x{m}' for b, m in shapes)}), "
            f"not the global batch {global_batch}"
        )
    return slices


class DeterministicBatches:
    """The micro-batches of any replica at any step, from (source, seed, B) only."""

    def __init__(self, source: SampleSource, global_batch: int, seed: int) -> None:
        self.source = source
        self.global_batch = int(global_batch)
        self.seed = int(seed)

    def step_indices(self, step: int) -> np.ndarray:
        return step_sample_indices(step, self.global_batch, self.source.num_samples, self.seed)

    def micro_batches(self, step: int, replica: ReplicaSlice) -> list[MicroBatch]:
        """Replica's micro-batches of `step`, in micro-batch order."""
        indices = self.step_indices(step)[replica.start : replica.start + replica.samples]
        b = replica.micro_batch_size
        return [self.source.batch(indices[j * b : (j + 1) * b].tolist()) for j in range(replica.micro_batches)]

    def global_batch_tensors(self, step: int) -> MicroBatch:
        """The whole step as one batch (single-device reference computations)."""
        return self.source.batch(self.step_indices(step).tolist())
