"""What the measured and published runs say of GEMM efficiency by shape (issue #45): a what-if.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gemm_shapes.py [--no-write]

The compute model prices a GEMM at the device's large-GEMM efficiency times the useful fraction of
its output tiles' waves (`profile/compute_model.py`: `wave_efficiency` over 128x256, 256x128 and
128x128 tiles, CUTLASS's large 16-bit tiles). vTrain's single-node A100 rows (Bang et al.,
MICRO'24) are GEMM-bound at hidden 2048 and small enough at hidden 1024, t >= 2, for a GEMM's shape
to matter, so two readings of how cuBLAS runs small products are tried against them and against
the published large-scale runs (`published_runs.yaml`, layouts pinned), whose GEMMs are large:

- `smaller_tiles`: cuBLAS also has 128x64 and 64x128 tiles (`smaller_tiles_64`: and 64x64), which
  fill the SMs of a small product better at a lower per-tile efficiency the model does not price;
- `k_prologue_K`: each output tile pays a fixed cost of K steps of its k loop (CUTLASS's multistage
  pipeline fills its shared-memory stages before the first multiply-accumulate and writes the tile
  after the last), so a GEMM's time is (k + K) / k times the model's: products with a short k (a
  tensor-parallel shard's h / t) run further below the large-GEMM figure.

Each reading is priced from the catalog's figures unchanged (the large-GEMM efficiency was measured
on products of large k, where K costs a few per cent), and the shared rows also with the terms
`pipectl calibrate` fitted to them (`results/measured_runs.json`; those terms were fitted without
K, so their errors are an indication, not a cross-validated figure). Nothing is fitted here; the
rows only say which reading they agree with. A diagnostic, not a term the predictions use. Writes
benchmarks/results/gemm_shapes.json with the command and date.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import pipectl.profile.compute_model as compute_model  # noqa: E402
import pipectl.profile.layer_shapes as layer_shapes  # noqa: E402
from memory_kernels import SHARED_RUNS, predict_both, write_readings  # noqa: E402
from pipectl.artifacts.calibration import CalibratedTerms  # noqa: E402
from pipectl.measured.predict import Calibrated, Predictor  # noqa: E402
from pipectl.measured.runs import load_conditions, read_runs  # noqa: E402
from pipectl.measured.summary import summarise_errors  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gemm_shapes.json"
MEASURED_RUNS = ROOT / "benchmarks" / "results" / "measured_runs.json"
SMALLER_TILES = ((128, 64), (64, 128))


@contextmanager
def gemm_shapes(*, tiles: tuple[tuple[int, int], ...] = (), k_prologue: int = 0):
    """GEMMs priced with `tiles` among cuBLAS's choices and `k_prologue` k-steps of fixed cost per
    tile, while inside; the model as it is after."""
    original_tiles, original_gemm, original_batched = compute_model.GEMM_TILES, compute_model.gemm_kernel, compute_model._batched_gemm

    def slowed(kernel: compute_model.Kernel, k: int) -> compute_model.Kernel:
        factor = (k + k_prologue) / k
        return compute_model.Kernel(kernel.name, kernel.flops, kernel.bytes_moved, kernel.seconds * factor, kernel.blocks_host)

    def gemm(name, m, n, k, device):
        return slowed(original_gemm(name, m, n, k, device), k)

    def batched(name, batch, m, n, k, device):
        return slowed(original_batched(name, batch, m, n, k, device), k)

    compute_model.GEMM_TILES = original_tiles + tuple(tiles)
    if k_prologue:  # both modules that price GEMMs (layer_shapes: the head's logits, the MLP layers)
        compute_model.gemm_kernel = layer_shapes.gemm_kernel = gemm
        compute_model._batched_gemm = batched
    try:
        yield
    finally:
        compute_model.GEMM_TILES = original_tiles
        compute_model.gemm_kernel = layer_shapes.gemm_kernel = original_gemm
        compute_model._batched_gemm = original_batched


def calibrated_errors(runs, conditions) -> dict:
    """The shared rows' errors with the fitted terms of `results/measured_runs.json`."""
    terms = CalibratedTerms(**json.loads(MEASURED_RUNS.read_text())["calibrated"]["terms"])
    predictor = Predictor(conditions, runs, Calibrated(conditions.device, terms))
    summary = summarise_errors([predictor.predict(run) for run in runs]).to_dict()
    return {key: round(value, 4) if isinstance(value, float) else value for key, value in summary.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="do not update the results file")
    args = parser.parse_args()
    runs = read_runs(SHARED_RUNS / "single-node.csv")
    conditions = load_conditions(SHARED_RUNS / "conditions.yaml")
    readings = {
        "as_modelled": {},
        "smaller_tiles": {"tiles": SMALLER_TILES},
        "smaller_tiles_64": {"tiles": (*SMALLER_TILES, (64, 64))},
        "k_prologue_32": {"k_prologue": 32},
        "k_prologue_64": {"k_prologue": 64},
        "k_prologue_128": {"k_prologue": 128},
    }
    started = time.perf_counter()
    results = {}
    for label, reading in readings.items():
        with gemm_shapes(**reading):
            results[label] = {**predict_both(runs, conditions), "shared_rows_calibrated": calibrated_errors(runs, conditions)}
        shared, published = results[label]["shared_rows"], results[label]["published_runs"]
        calibrated = results[label]["shared_rows_calibrated"]
        print(f"{label:>16}: shared rows MAPE {shared['mape']:.1%}, signed median {shared['signed_median_error']:+.1%} "
              f"({', '.join(f'{h} {e:+.1%}' for h, e in shared['signed_median_by_hidden'].items())}), calibrated "
              f"{calibrated['mape']:.1%}; published runs median {published['median_abs_error']:.1%}, max "
              f"{published['max_abs_error']:.1%}, mean signed {published['mean_signed_error']:+.1%}")
    if args.no_write:
        return
    write_readings(RESULTS, started, results)


if __name__ == "__main__":
    main()
