# pipectl 0.1.0: DeepSpeed's PipelineModule settings for plan llama3-8b-deepspeed/plan.json (sha256 5d7cfe16988a), profile profile-64c365a94447.json
# model llama3-8b, global batch 512, cluster a100-8x8
# layout t1p2d32 1f1b b1 m16 ZeRO-1 on 64 x a100-80gb (8 nodes of 8): predicted 9.264 s/step, peak 44.7 GiB per device
#
# What this framework does that pipectl's prediction did not price (how far the step time holds here):
# - the prediction is for DeepSpeed's own pipeline engine (pipectl's runtime runs the same); your layers must be those of the profile, in its order, for the cut and the times to hold
# - the loss is priced as pipectl's (models.transformer.lm_loss); with yours, if it is an fp32 one, its fp32 cross-entropy (F.cross_entropy(logits.float(), labels)) needs up to 6 bytes more per logit on the last stage than the chunked loss pipectl priced

"""The plan's stage boundaries and rank layout for a DeepSpeed PipelineModule.

    from ds_pipeline import planned_pipeline_module
    model = planned_pipeline_module(layer_specs, loss_fn=loss_fn)   # your LayerSpec list, in the order below
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config="ds_config.json")
"""

from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import ProcessTopology

# Stage s holds layers [PARTS[s], PARTS[s + 1]) of the layer list the plan cut:
#   stage 0: layers 0-17 (embed .. block.16)
#   stage 1: layers 18-34 (block.17 .. head)
PARTS = [0, 18, 35]
PIPELINE_PARALLEL, TENSOR_PARALLEL, DATA_PARALLEL = 2, 1, 32
ACTIVATION_CHECKPOINT_INTERVAL = 0  # 1: every layer recomputes its forward in the backward


class PlannedPipelineModule(PipelineModule):
    """A PipelineModule cut at PARTS (DeepSpeed calls _partition_layers from its __init__)."""

    def _partition_layers(self, method="uniform"):
        if len(self._layer_specs) != PARTS[-1]:
            raise ValueError(f"the plan cut {PARTS[-1]} layers; this PipelineModule has {len(self._layer_specs)}")
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
