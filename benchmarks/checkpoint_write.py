"""How fast a rank file reaches the disk with its sha256 (issue #46: the background write keeps up).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint_write.py [--gib 1] [--repeats 3] [--dir DIR] [--no-write]

Writes one rank's worth of fp32 state (`--gib`, in four flat tensors as a ZeRO-1 rank holds its
master weights and Adam's moments) to `--dir` (default: a temporary folder beside the checkpoint
runs of this machine) two ways, alternately, `--repeats` times each:

- before: safetensors' `save_file`, then fsync, then a second pass reading the file back to hash it
  (what pipectl did before: write, fsync and sha256 one after the other);
- now: `runtime.checkpoint.shards.write_rank_file`, which hashes each chunk on a second thread while
  the next is written, and hands what it wrote to the kernel's writeback every 64 MiB;
- no_flush_behind: the same without the writeback hand-off (the whole file flushed by the fsync).

Beside them, what bounds both: the disk (`dd` of the same size with conv=fsync) and one core's
sha256 over the same bytes in memory. Prints GB/s (1e9 bytes per second) and the ratio now/before
in one run; writes benchmarks/results/checkpoint_write.json with the command, machine and date.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from pipectl.io import sha256_file, write_json_atomic  # noqa: E402
from pipectl.runtime.checkpoint import shards  # noqa: E402
from pipectl.runtime.checkpoint.shards import HEADER_KEY, RankHeader, write_rank_file  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "checkpoint_write.json"


def state(gib: float) -> dict[str, torch.Tensor]:
    elements = int(gib * 2**30 / 4 / 4)
    return {name: torch.rand(elements) for name in ("group0.fp32", "group0.exp_avg", "group0.exp_avg_sq", "group1.fp32")}


def before(path: Path, tensors: dict[str, torch.Tensor], header: RankHeader) -> str:
    save_file(tensors, str(path), metadata={HEADER_KEY: header.to_json()})
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    return sha256_file(path)


def now(path: Path, tensors: dict[str, torch.Tensor], header: RankHeader) -> str:
    return write_rank_file(path, tensors, header).sha256


def no_flush_behind(path: Path, tensors: dict[str, torch.Tensor], header: RankHeader) -> str:
    kept = shards.FLUSH_BEHIND_BYTES
    shards.FLUSH_BEHIND_BYTES = 1 << 62
    try:
        return write_rank_file(path, tensors, header).sha256
    finally:
        shards.FLUSH_BEHIND_BYTES = kept


def dd_seconds(path: Path, nbytes: int) -> float:
    started = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={nbytes // (16 << 20)}", "conv=fsync"],
                   check=True, capture_output=True)  # fmt: skip
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    tensors = state(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    header = RankHeader(rank=0, stage=0, step=1, world_size=1, fragments=[])
    buffer = torch.cat([t.reshape(-1) for t in tensors.values()]).view(torch.uint8).numpy()
    started = time.perf_counter()
    hashlib.sha256(memoryview(buffer)).hexdigest()
    hash_seconds = time.perf_counter() - started
    del buffer
    seconds: dict[str, list[float]] = {"before": [], "now": [], "no_flush_behind": [], "dd": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        target = Path(folder) / "rank-00000.safetensors"
        for _ in range(args.repeats):
            for name, write in (("before", before), ("now", now), ("no_flush_behind", no_flush_behind)):
                started = time.perf_counter()
                digest = write(target, tensors, header)
                seconds[name].append(time.perf_counter() - started)
                assert digest == sha256_file(target)
                target.unlink()
            seconds["dd"].append(dd_seconds(Path(folder) / "dd.bin", nbytes))
    rate = {name: nbytes / statistics.median(values) / 1e9 for name, values in seconds.items()}
    rate["sha256_in_memory"] = nbytes / hash_seconds / 1e9
    for name, value in rate.items():
        print(f"  {name:<18} {value:.2f} GB/s")
    print(f"  now / before       {rate['now'] / rate['before']:.2f}x")
    print(f"  now / no flush     {rate['now'] / rate['no_flush_behind']:.2f}x")
    if args.no_write:
        return
    write_json_atomic(RESULTS, {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint_write.py"
                   + (f" --gib {args.gib:g}" if args.gib != 1.0 else "") + (f" --repeats {args.repeats}" if args.repeats != 3 else ""),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
        "bytes": nbytes,
        "seconds": seconds,
        "gbytes_per_second": {name: round(value, 3) for name, value in rate.items()},
        "now_over_before": round(rate["now"] / rate["before"], 3),
        "now_over_no_flush_behind": round(rate["now"] / rate["no_flush_behind"], 3),
    })  # fmt: skip
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
