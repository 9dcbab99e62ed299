"""Pydantic models of every artifact pipectl writes or reads, one module per artifact.

Every model is versioned (`schema_version`), forbids unknown fields and documents each field.
"""

from pipectl.artifacts.base import Artifact, Strict
from pipectl.artifacts.cluster import ClusterSpec, LinkSpec, NodeType
from pipectl.artifacts.model import ModelConfig, ModelFamily
from pipectl.artifacts.profile import LayerCost, LayerProfile, LinkClassFit, LinksProfile, ModelProfile

__all__ = [
    "Artifact",
    "ClusterSpec",
    "LayerCost",
    "LayerProfile",
    "LinkClassFit",
    "LinkSpec",
    "LinksProfile",
    "ModelConfig",
    "ModelFamily",
    "ModelProfile",
    "NodeType",
    "Strict",
]
