"""A plan layout for a DeepSpeed `PipelineModule` script of one's own: `ds_config.json` and
`ds_pipeline.py`.

`ds_config.json` holds what the plan decides (batch sizes, gradient accumulation, ZeRO stage,
precision), checked by DeepSpeed's own parser (`runtime.engines.dsconfig.parse_with_deepspeed`); plain
JSON, so merge your optimizer and scheduler sections into it. `ds_pipeline.py` holds the cut:
`PipelineModule(partition_method=...)` offers only `parameters`, `uniform` and `type:regex`
(DeepSpeed issues #2974, #5078), so a subclass installs the plan's boundaries (`parts`) in
`_partition_layers`, as pipectl's runtime does (`runtime.engines.pipeline.PlannedPipelineModule`), and lays
the ranks out as the plan priced them (a replica's stages on consecutive ranks).
"""

from __future__ import annotations

import json

from pipectl.artifacts.plan import Framework, Recompute
from pipectl.artifacts.run import Precision
from pipectl.emit.common import FP32_LOSS, Target, engine_differences, header, profile_is_pipectls
from pipectl.runtime.engines.dsconfig import batch_section, parse_with_deepspeed, stage_partition

CONFIG_FILE = "ds_config.json"
MODULE_FILE = "ds_pipeline.py"

PRECISIONS = {"bfloat16": Precision.BF16, "float16": Precision.FP16, "float32": Precision.FP32}


def deepspeed_files(target: Target) -> dict[str, str]:
    config = ds_config(target)
    parse_with_deepspeed(config, target.candidate.data_parallel)  # DeepSpeed's own checks, or exit 2 naming them
    return {CONFIG_FILE: json.dumps(config, indent=2) + "\n", MODULE_FILE: pipeline_module(target)}


def ds_config(target: Target) -> dict:
    c = target.candidate
    config: dict = {
        **batch_section(micro_batch_size=c.micro_batch_size, micro_batches=c.micro_batches, data_parallel=c.data_parallel),
        "zero_optimization": {"stage": c.zero_stage},
    }
    config["train_batch_size"] = target.plan.global_batch  # the plan's B: DeepSpeed checks b x m x d against it
    precision = PRECISIONS.get(target.profile.dtype, Precision.FP32)
    if precision is Precision.BF16:
        config["bf16"] = {"enabled": True}
    elif precision is Precision.FP16:
        config["fp16"] = {"enabled": True, "loss_scale": 0}  # dynamic loss scaling
    return config


MODULE_TEMPLATE = '''
"""The plan's stage boundaries and rank layout for a DeepSpeed PipelineModule.

    from ds_pipeline import planned_pipeline_module
    model = planned_pipeline_module(layer_specs, loss_fn=loss_fn)   # your LayerSpec list, in the order below
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config="ds_config.json")
"""

from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import ProcessTopology

# Stage s holds layers [PARTS[s], PARTS[s + 1]) of the layer list the plan cut:
{stages}
PARTS = {parts}
PIPELINE_PARALLEL, TENSOR_PARALLEL, DATA_PARALLEL = {p}, {t}, {d}
ACTIVATION_CHECKPOINT_INTERVAL = {interval}  # 1: every layer recomputes its forward in the backward


class PlannedPipelineModule(PipelineModule):
    """A PipelineModule cut at PARTS (DeepSpeed calls _partition_layers from its __init__)."""

    def _partition_layers(self, method="uniform"):
        if len(self._layer_specs) != PARTS[-1]:
            raise ValueError(f"the plan cut {{PARTS[-1]}} layers; this PipelineModule has {{len(self._layer_specs)}}")
        self.parts = list(PARTS)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def planned_topology():
    """Ranks as the plan priced them: rank = (replica x p + stage) x t + tensor rank."""
    if TENSOR_PARALLEL > 1:  # your layers split themselves over the "model" axis (Megatron-style)
        return ProcessTopology(axes=["data", "pipe", "model"], dims=[DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL])
    return ProcessTopology(axes=["data", "pipe"], dims=[DATA_PARALLEL, PIPELINE_PARALLEL])


def planned_pipeline_module(layers, **kwargs):
    kwargs.setdefault("activation_checkpoint_interval", ACTIVATION_CHECKPOINT_INTERVAL)
    return PlannedPipelineModule(layers=layers, topology=planned_topology(), **kwargs)
'''


def pipeline_module(target: Target) -> str:
    c = target.candidate
    names = [layer.name for layer in target.profile.layers]
    stages = "\n".join(
        f"#   stage {stage}: layers {start}-{end - 1} ({names[start]}" + (f" .. {names[end - 1]})" if end - start > 1 else ")")
        for stage, (start, end) in enumerate(c.stage_layers)
    )
    body = MODULE_TEMPLATE.format(
        stages=stages, parts=stage_partition([tuple(r) for r in c.stage_layers]), p=c.pipeline_parallel,
        t=c.tensor_parallel, d=c.data_parallel, interval=1 if c.recompute_granularity is Recompute.LAYER else 0,
    )
    return header(target, Framework.DEEPSPEED, differences(target)) + body


# Engine features (`EngineFeatures`) DeepSpeed's pipeline engine does not have whatever the layers
# are: it reduces gradients after the last backward and gathers ZeRO-1's parameters after the step
# (deepspeed/runtime/pipe/engine.py `_exec_reduce_grads`, `_exec_optimizer_step`).
DEEPSPEED_LACKS = frozenset({"gradient_reduce_overlap", "parameter_gather_overlap"})


def differences(target: Target) -> list[str]:
    c = target.candidate
    notes = engine_differences(target.profile, [], "DeepSpeed's pipeline engine", DEEPSPEED_LACKS)
    notes.append(
        "the prediction is for DeepSpeed's own pipeline engine (pipectl's runtime runs the same); your layers must "
        "be those of the profile, in its order, for the cut and the times to hold"
    )
    if profile_is_pipectls(target):
        notes.append("the loss is priced as pipectl's (models.transformer.lm_loss); with yours, if it is an fp32 one, "
                     + FP32_LOSS.format(who="F.cross_entropy(logits.float(), labels)"))
    if c.tensor_parallel > 1:
        notes.append(f"tensor parallelism t = {c.tensor_parallel}: priced as pipectl's split blocks; your layers "
                     "must split themselves over the topology's model axis")
    if target.profile.dtype == "bfloat16" and c.zero_stage == 0 and c.pipeline_parallel > 1 and c.data_parallel > 1:
        # deepspeed/runtime/engine.py `_do_optimizer_sanity_check`: bf16 under a pipeline without ZeRO
        # returns BFLOAT16 (runtime/bf16_optimizer.py), which partitions its fp32 state.
        notes.append("bf16 under a pipeline runs DeepSpeed's BF16_Optimizer whatever stage 0 says: it splits the fp32 "
                     "master weights and Adam's state over the data-parallel ranks (less memory than priced) and "
                     "all-gathers the parameters after each step (not priced)")
    return notes
