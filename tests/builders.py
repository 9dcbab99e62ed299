"""Small artifact builders shared by tests."""

from __future__ import annotations

from pipectl.artifacts.plan import Candidate


def gpt_tiny_candidate(p: int = 2, d: int = 1, b: int = 2, m: int = 4) -> Candidate:
    """A 1F1B ZeRO-1 candidate for gpt-tiny (9 layers): one stage, or cut [0,4) [4,9) for p=2."""
    cuts = [(0, 9)] if p == 1 else [(0, 4), (4, 9)]
    return Candidate(
        devices=p * d, device="cpu", tensor_parallel=1, pipeline_parallel=p, data_parallel=d,
        micro_batch_size=b, micro_batches=m, schedule="1f1b", recompute=False, zero_stage=1,
        stage_layers=cuts, predicted_step_seconds=0.05, samples_per_second=160.0, tflops_per_device=0.0,
        peak_memory_bytes=[1] * p, bubble_fraction=0.0, communication_fraction=0.0,
        cost_per_million_samples=0.0,
    )  # fmt: skip
