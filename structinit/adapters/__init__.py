"""Finding layers in a model and reading/writing their weights in one layout: attention
adapters (fused qkv, separate q/k/v, ``nn.MultiheadAttention``, or your own), their registry,
position-embedding finders and theirs, the token layout (grid, prefix tokens,
position-embedding rows), and SSM (Mamba) layers and their adapters."""

from structinit.adapters.attention import (
    AttentionAdapter,
    FusedQKVAdapter,
    MultiheadAttentionAdapter,
    is_self_attention,
)
from structinit.adapters.conv import find_depthwise_convs, is_depthwise
from structinit.adapters.gated import GatedPositionalAdapter
from structinit.adapters.layout import TokenLayout, grid_pos_embed, infer_layout, position_embedding_name
from structinit.adapters.position import (
    POSITION_FINDERS,
    Discovery,
    register_position_finder,
    unregister_position_finder,
)
from structinit.adapters.registry import (
    ATTENTION_ADAPTERS,
    AdapterEntry,
    adapter_for,
    register_adapter,
    select_layers,
    unregister_adapter,
)
from structinit.adapters.separate import SeparateQKVAdapter
from structinit.adapters.ssm import (
    SSM_ADAPTERS,
    HuggingFaceMambaAdapter,
    MambapyAdapter,
    SSMAdapter,
    find_ssm_layers,
    is_ssm,
    register_ssm_adapter,
    ssm_adapter_for,
    unregister_ssm_adapter,
)
from structinit.adapters.survey import (
    ModelSurvey,
    attention_survey,
    find_attention_layers,
    find_position_embedding,
    layer_relative_bias,
)
from structinit.adapters.token_mixing import find_token_mixing_layers, is_token_mixing, token_grid

__all__ = [
    "POSITION_FINDERS", "Discovery", "find_position_embedding", "position_embedding_name",
    "register_position_finder", "unregister_position_finder",
    "ATTENTION_ADAPTERS", "AdapterEntry", "AttentionAdapter", "FusedQKVAdapter", "MultiheadAttentionAdapter",
    "SeparateQKVAdapter", "GatedPositionalAdapter", "ModelSurvey",
    "TokenLayout", "adapter_for", "attention_survey", "find_attention_layers", "grid_pos_embed", "layer_relative_bias",
    "infer_layout", "is_self_attention", "find_depthwise_convs", "is_depthwise", "find_token_mixing_layers",
    "is_token_mixing", "token_grid",
    "register_adapter", "select_layers", "unregister_adapter",
    "SSM_ADAPTERS", "SSMAdapter", "HuggingFaceMambaAdapter", "MambapyAdapter", "find_ssm_layers", "is_ssm",
    "register_ssm_adapter", "ssm_adapter_for", "unregister_ssm_adapter",
]  # fmt: skip
