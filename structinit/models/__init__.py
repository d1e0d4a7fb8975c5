"""Model architectures and their registered entry points (timm style). Importing this
package registers every model."""

from structinit.models.convit import GPSA, ConViT
from structinit.models.convmixer import ConvMixer, ConvMixerBlock, convmixer_num_params
from structinit.models.kwlarge import KWLarge
from structinit.models.layers_orthogonal import CayleyConv2d, CayleyLinear, GroupSort, LipschitzAvgPool, SpaceToDepth
from structinit.models.mixer import MixerBlock, MlpMixer
from structinit.models.registry import MODELS, create_model, list_models, register_model
from structinit.models.sequence import CausalTransformer, MambaLM
from structinit.models.swin import SwinTransformer, SwinTransformerBlock, WindowAttention
from structinit.models.vit import VisionTransformer

__all__ = ["GPSA", "MODELS", "CausalTransformer", "CayleyConv2d", "CayleyLinear", "ConViT", "ConvMixer",
           "ConvMixerBlock", "GroupSort", "KWLarge", "LipschitzAvgPool", "MambaLM", "MixerBlock", "MlpMixer",
           "SpaceToDepth", "SwinTransformer", "SwinTransformerBlock", "VisionTransformer", "WindowAttention",
           "convmixer_num_params", "create_model", "list_models", "register_model"]
