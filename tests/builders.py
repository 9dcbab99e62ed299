"""Small artifact builders shared by tests."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from pipectl.artifacts.plan import Candidate, ModelShape, MorphEntry, Plan, PlanRequest, ReplicaShare, replica_shares

if TYPE_CHECKING:  # torch only where a helper needs it: planner tests import this module too
    import torch

    from pipectl.models.tensor_parallel import TensorSplit
    from pipectl.plan.stage_costs import StageCosts


def gpt_tiny_candidate(p: int = 2, d: int = 1, b: int = 2, m: int = 4, *, global_batch: int | None = None) -> Candidate:
    """A 1F1B ZeRO-1 candidate for gpt-tiny (9 layers): one stage, or cut [0,4) [4,9) for p=2.
    With `global_batch`, its micro-batches are dealt out over the d replicas (`replica_shares`:
    uneven where d does not divide B / b) and m is the most any replica runs."""
    cuts = [(0, 9)] if p == 1 else [(0, 4), (4, 9)]
    replicas = None
    if global_batch is not None:
        replicas = replica_shares(global_batch, d, b, "cpu")
        m = max(r.micro_batches for r in replicas) if replicas else global_batch // (d * b)
    return Candidate(
        replicas=replicas,
        devices=p * d, device="cpu", tensor_parallel=1, pipeline_parallel=p, data_parallel=d,
        micro_batch_size=b, micro_batches=m, schedule="1f1b", recompute=False, zero_stage=1,
        stage_layers=cuts, predicted_step_seconds=0.05, samples_per_second=160.0, tflops_per_device=0.0,
        peak_memory_bytes=[1] * p, bubble_fraction=0.0, communication_fraction=0.0,
        cost_per_million_samples=0.0,
    )  # fmt: skip


def gpt_tiny_torch_candidate(schedule: str, p: int = 2, v: int = 1, b: int = 2, m: int = 4) -> Candidate:
    """A candidate for the torch engine (PyTorch's pipelining runtime): gpt-tiny cut into p x v
    virtual stages as evenly as can be ([0,4) [4,9) for p = 2, v = 1, as `gpt_tiny_candidate`)."""
    from pipectl.artifacts.plan import Engine
    from pipectl.schedule import ScheduleKind

    stages = p * v
    base, extra = divmod(9, stages)
    cuts, start = [], 0
    for s in range(stages):
        stop = start + base + (1 if s >= stages - extra else 0)
        cuts.append((start, stop))
        start = stop
    return gpt_tiny_candidate(p, 1, b=b, m=m).model_copy(
        update={"schedule": ScheduleKind(schedule), "chunks": v, "stage_layers": cuts, "engine": Engine.TORCH,
                "deepspeed_runnable": False, "peak_memory_bytes": [1] * p}
    )


def mixed_candidate(shares: dict[str, int] | None = None, *, global_batch: int = 16) -> Candidate:
    """gpt-tiny split over device kinds (`local-mixed`: 'cpu' and the emulated 'cpu-slowed-2x'), one
    replica per kind, one stage, micro-batches of 1 sample: `shares` is each kind's micro-batches
    (default 11 and 5: 16 micro-batches water-filled over a kind and one twice as slow)."""
    shares = shares or {"cpu": 11, "cpu-slowed-2x": 5}
    assert sum(shares.values()) == global_batch
    replicas = [
        ReplicaShare(replica=r, device=kind, micro_batch_size=1, micro_batches=m, samples=m, gradient_weight=m / global_batch)
        for r, (kind, m) in enumerate(shares.items())
    ]
    return gpt_tiny_candidate(1, len(replicas), b=1, m=max(shares.values())).model_copy(
        update={"device": "mixed", "replicas": replicas}
    )


@lru_cache(maxsize=None)
def model_shape(model: str = "gpt-tiny") -> ModelShape:
    """The shape a profile of the shipped `model` records (what launch checks a model against)."""
    from pipectl.models import build_model
    from pipectl.models.base import shape_of

    return shape_of(build_model(model, allow_shape_only=True))  # counted on the meta device


def plan_of(
    chosen: Candidate,
    *,
    morph_table: list[MorphEntry] | tuple = (),
    global_batch: int | None = None,
    cluster: str = "local",
    model: str = "gpt-tiny",
    shape: ModelShape | None = None,
    **fields,
) -> Plan:
    """A plan of `model` choosing `chosen` (B = its global batch unless given); `fields` go to Plan."""
    batch = chosen.global_batch if global_batch is None else global_batch
    return Plan(
        model=model, model_shape=shape or model_shape(model), cluster=cluster,
        request=PlanRequest(global_batch=batch), chosen=chosen, morph_table=list(morph_table), **fields,
    )  # fmt: skip


def training_config(layout, *, zero_stage: int = 1, weight_decay: float | None = None) -> dict:
    """The parts of `pipectl launch`'s DeepSpeed config that matter to loss tests: the layout's
    batch keys, AdamW (torch implementation) at lr 3e-3, clipping at 1.0, the ZeRO stage."""
    params: dict = {"lr": 3e-3, "torch_adam": True}
    if weight_decay is not None:
        params["weight_decay"] = weight_decay
    config = {
        "train_batch_size": layout.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.micro_batches,
        "steps_per_print": 1_000_000,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": {"stage": zero_stage},
    }
    return config


def train_run(plan: Plan, run_dir, steps: int, *, warmup_steps: int, timeout_seconds: float):
    """`steps` steps of `plan` in `run_dir` through the run-directory contract (`prepare_launch` +
    `run_engine`, real ranks), seed 0; the engine log's tail if it fails. Returns the run dir."""
    from pipectl.launch import LaunchOptions, prepare_launch, run_engine

    prepared = prepare_launch(plan, run_dir, LaunchOptions(steps=steps, seed=0, warmup_steps=warmup_steps))
    exit_code = run_engine(prepared.command, prepared.run_dir, timeout_seconds=timeout_seconds)
    assert exit_code == 0, (run_dir / "logs" / "engine.log").read_text()[-3000:]
    return prepared.run_dir


def final_weights(run_dir, step: int) -> dict:
    """fp32 weights by parameter name from the newest checkpoint, which must be of `step`, whole
    (any layout gives the same names)."""
    from pipectl.rundir.checkpoints import find_latest_verified
    from pipectl.runtime.checkpoint.shards import whole_state

    info, _ = find_latest_verified(run_dir)
    assert info is not None and info.step == step
    return whole_state(info.path)


def assert_same_weights(weights: dict, reference: dict, tolerance: float) -> None:
    """Same names, and per tensor a difference within `tolerance` relative to its norm: elements
    near zero (Adam moves them by ~lr whatever their gradient's size) make an element-wise
    relative test meaningless there."""
    import torch

    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        difference = torch.linalg.vector_norm(tensor - reference[name]) / torch.linalg.vector_norm(reference[name])
        assert difference.item() <= tolerance, (name, difference.item())


def random_stage_costs(p: int, v: int, rng, spread: float = 1.0):
    """Non-uniform stages and links for p ranks of v chunks; `spread` < 1 makes stages nearly
    equal (long transients), 0 makes them equal."""
    from pipectl.plan.stage_costs import StageCosts

    s = p * v
    return StageCosts(
        forward_seconds=[1.0 + spread * rng.uniform(-0.5, 1.0) for _ in range(s)],
        backward_seconds=[2.0 + spread * rng.uniform(-1.0, 2.0) for _ in range(s)],
        recompute_seconds=[1.0 + spread * rng.uniform(-0.5, 1.0) for _ in range(s)],
        send_forward_seconds=[rng.uniform(0.0, 0.5) for _ in range(s - 1)],
        send_backward_seconds=[rng.uniform(0.0, 0.5) for _ in range(s - 1)],
        allreduce_seconds=[rng.uniform(0.0, 3.0) for _ in range(p)],
        optimizer_seconds=[rng.uniform(0.0, 1.0) for _ in range(p)],
    )


def head_start_costs(stages: int, p: int, slower: float, heavier_last: float, rng=None, *,
                     alternating_links: bool = True) -> StageCosts:
    """Equal stages but a first one `slower` (relative) and a last one `heavier_last` seconds
    heavier; links alternate between a fast and a slow one (ranks inside / across nodes), or
    are all the slow one."""
    forward = [0.15] * stages
    backward = [0.3] * stages
    forward[0] *= 1 + slower
    backward[0] *= 1 + slower
    forward[-1] += heavier_last / 3
    backward[-1] += 2 * heavier_last / 3
    if rng is not None:  # tiny per-stage noise: nearly equal, not equal
        forward = [f * (1 + rng.uniform(0, 1e-5)) for f in forward]
    sends = [0.0004 if s % 2 and alternating_links else 0.004 for s in range(stages - 1)]
    from pipectl.plan.stage_costs import StageCosts

    return StageCosts(
        forward_seconds=forward, backward_seconds=backward, recompute_seconds=forward,
        send_forward_seconds=sends, send_backward_seconds=sends,
        allreduce_seconds=[0.5] * p, optimizer_seconds=[0.1] * p,
    )  # fmt: skip


def write_shard_layout(folder: Path, parameters: dict[str, tuple[torch.Tensor, TensorSplit | None]], *, t: int, d: int,
                       stages: dict[str, tuple[int, ...]] | None = None) -> int:  # fmt: skip
    """Rank files without processes (tests/runtime/test_shards.py, test_live.py): write what t
    tensor ranks x d data-parallel ranks (x the stages in `stages`, default 0) hold of
    `parameters`, the way ZeRO-1 lays it out: each tensor slice's parameters flattened one after
    the other, the flat group cut into d equal partitions. Returns the number of rank files."""
    import torch

    from pipectl.artifacts.run import rank_file_name

    from pipectl.runtime.checkpoint.shards import Fragment, RankHeader, write_rank_file

    stages = stages or {}
    stage_ids = sorted({s for name in parameters for s in stages.get(name, (0,))})
    rank = 0
    for stage in stage_ids:
        names = [n for n in parameters if stage in stages.get(n, (0,))]
        for tp_rank in range(t):
            slices = {n: (split.cut(value, t, tp_rank) if split else value) for n, (value, split) in parameters.items()}
            flat = torch.cat([slices[n].reshape(-1) for n in names])
            flat = torch.cat([flat, torch.zeros((-flat.numel()) % d)])  # ZeRO pads to a multiple of d
            size = flat.numel() // d
            starts, offset = {}, 0
            for n in names:
                starts[n] = offset
                offset += slices[n].numel()
            for dp_rank in range(d):
                low, high = dp_rank * size, (dp_rank + 1) * size
                fragments = []
                for n in names:
                    begin, end = max(low, starts[n]), min(high, starts[n] + slices[n].numel())
                    if begin < end:
                        fragments.append(Fragment(n, 0, begin - low, begin - starts[n], end - begin,
                                                  tuple(slices[n].shape), stage, tp_rank, t, parameters[n][1]))  # fmt: skip
                header = RankHeader(rank=rank, stage=stage, step=7, world_size=0, data_parallel_rank=dp_rank,
                                    tp_rank=tp_rank, tensor_parallel=t, fragments=fragments,
                                    group_states=[["exp_avg"]], group_scalars=[[]], group_settings=[{"lr": 0.1}])  # fmt: skip
                part = flat[low:high]
                tensors = {"group0.fp32": part.clone(), "group0.exp_avg": part * 3, "rng.torch": torch.get_rng_state()}
                write_rank_file(folder / rank_file_name(rank), tensors, header)
                rank += 1
    return rank


def shard_model(seed: int = 0) -> dict[str, tuple[torch.Tensor, TensorSplit | None]]:
    """Parameters like a GPT's: a tied table, a fused QKV and a row-split projection, a bias."""
    import torch

    from pipectl.models.tensor_parallel import QKV, ROWS

    generator = torch.Generator().manual_seed(seed)
    return {
        "tied_modules.embed.weight": (torch.randn(10, 4, generator=generator), None),
        "3.qkv.weight": (torch.randn(24, 8, generator=generator), QKV),
        "3.proj.weight": (torch.randn(8, 8, generator=generator), ROWS),
        "3.ln.bias": (torch.randn(8, generator=generator), None),
    }


def write_plan(path: Path, p=2, b=2, m=4, zero_stage=1) -> Path:
    """plan.json for gpt-tiny on p CPU ranks, 1F1B (what CLI tests launch)."""
    from pipectl.io import write_json_atomic
    from pipectl.schedule.ir import ScheduleKind

    cuts = [(0, 4), (4, 9)] if p == 2 else [(0, 9)]
    candidate = Candidate(
        devices=p, device="cpu", tensor_parallel=1, pipeline_parallel=p, data_parallel=1,
        micro_batch_size=b, micro_batches=m, schedule=ScheduleKind.ONE_F_ONE_B, recompute=False,
        zero_stage=zero_stage, stage_layers=cuts, predicted_step_seconds=0.05, samples_per_second=160.0,
        tflops_per_device=0.0, peak_memory_bytes=[1] * p, bubble_fraction=0.1,
        communication_fraction=0.0, cost_per_million_samples=0.0,
    )  # fmt: skip
    plan = plan_of(candidate)
    return write_json_atomic(path, plan)
