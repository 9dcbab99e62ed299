"""pipectl's language-model loss against eager fp32 cross-entropy: time and memory (issue #46).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lm_loss.py [--device cpu|cuda] [--tokens 4096]
        [--vocab 51200] [--dtype bfloat16] [--repeats 5] [--out FILE]

Times forward and backward of `pipectl.models.transformer.lm_loss` and of
`F.cross_entropy(logits.float(), labels)` on the same logits ([tokens, vocab], `--dtype`),
alternately, `--repeats` times each after one warm-up; prints the medians and their ratio from one
run. Memory: the bytes each keeps for its backward (autograd's saved-tensor hooks, on any device)
and, on a GPU, the peak allocated beyond the logits during forward and backward. Writes the figures
with the command, device and date to `--out` (default benchmarks/results/lm_loss-<device>.json).
On a CPU the ratio is a check of the code, not the GPU figure: the loss is memory-bound on a GPU.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipectl.io import write_json_atomic  # noqa: E402
from pipectl.models.transformer import lm_loss  # noqa: E402


def eager(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_once(loss_of, logits: torch.Tensor, labels: torch.Tensor, device: str) -> tuple[float, int | None]:
    """Seconds of one forward and backward, and on a GPU the peak bytes allocated beyond the logits."""
    x = logits.detach().requires_grad_()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    started = time.perf_counter()
    loss_of(x, labels).backward()
    _sync(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    return seconds, peak


def saved_bytes(loss_of, logits: torch.Tensor, labels: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward (each saved tensor counted once)."""
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    x = logits.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(x, labels)
    return sum(size for pointer, size in kept.items() if pointer != x.untyped_storage().data_ptr())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=51200)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, generator=generator) * 2).to(dtype).to(args.device)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=generator).to(args.device)
    times: dict[str, list[float]] = {"pipectl": [], "eager": []}
    peaks: dict[str, list[int]] = {"pipectl": [], "eager": []}
    losses = {"pipectl": lm_loss, "eager": eager}
    for name, loss_of in losses.items():  # warm-up
        run_once(loss_of, logits, labels, args.device)
    for _ in range(args.repeats):
        for name, loss_of in losses.items():
            seconds, peak = run_once(loss_of, logits, labels, args.device)
            times[name].append(seconds)
            if peak is not None:
                peaks[name].append(peak)
    logit_bytes = logits.numel() * logits.element_size()
    result = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lm_loss.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.now(timezone.utc).date().isoformat(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} CPU",
        "torch": torch.__version__,
        "tokens": args.tokens, "vocab": args.vocab, "dtype": args.dtype, "repeats": args.repeats,
        "logit_bytes": logit_bytes,
        "seconds": {name: statistics.median(values) for name, values in times.items()},
        "saved_bytes": {name: saved_bytes(loss_of, logits, labels) for name, loss_of in losses.items()},
        "peak_bytes_beyond_logits": {name: max(values) for name, values in peaks.items() if values} or None,
    }  # fmt: skip
    result["eager_over_pipectl"] = result["seconds"]["eager"] / result["seconds"]["pipectl"]
    for name in losses:
        print(f"{name:8} {result['seconds'][name] * 1e3:9.2f} ms  saved {result['saved_bytes'][name] / logit_bytes:.2f} x the logits")
    print(f"eager / pipectl: {result['eager_over_pipectl']:.2f}x ({result['device']}, {args.dtype}, {args.tokens} x {args.vocab})")
    out = args.out or ROOT / "benchmarks" / "results" / f"lm_loss-{args.device}.json"
    write_json_atomic(out, result)
    return result


if __name__ == "__main__":
    main()
