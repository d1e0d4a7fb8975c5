"""Model architectures and their registered entry points (timm style). Importing this
package registers every model."""

from structinit.models.registry import MODELS, create_model, list_models, register_model
from structinit.models.vit import VisionTransformer

__all__ = ["MODELS", "VisionTransformer", "create_model", "list_models", "register_model"]
