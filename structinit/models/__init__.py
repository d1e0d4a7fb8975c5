from structinit.models.registry import PRESETS, create_model, list_models
from structinit.models.vit import VisionTransformer

__all__ = ["PRESETS", "VisionTransformer", "create_model", "list_models"]
