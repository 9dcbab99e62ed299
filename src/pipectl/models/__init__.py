"""Models as sequences of cuttable layers (`ModelLayers`), ready to become a DeepSpeed PipelineModule."""

from pipectl.models.base import LayerDef, ModelLayers
from pipectl.models.registry import build_model

__all__ = ["LayerDef", "ModelLayers", "build_model"]
