"""The models the registry sweep (``bench/sweep.py``) builds, one small model per family: timm's
smallest-sounding entry point of each module, transformers' image classifiers, vision towers and
language models shrunk to width 96 (or ``--width``), vit-pytorch's 2-D image models built small
from their signatures; and, for a tower whose forward takes patches, the call its processor makes."""

from __future__ import annotations

import importlib
import inspect
import itertools
import math
import pkgutil

import torch
from torch import nn

MAX_PARAMETERS = 60_000_000  # larger models take minutes a forward on a CPU core: skipped, and said so
SMALL_NAMES = ("atto", "femto", "pico", "nano", "tiny", "ti", "t", "micro", "mini", "small", "xxs", "xs", "s")



def smallest(names: list[str]) -> str:
    """The name that sounds smallest: an early size word (alone, or before a depth of two digits:
    ``s18``, not a stride: ``s8``), then the shortest name."""
    def rank(name: str):
        parts = [p.rstrip("0123456789") if len(p.rstrip("0123456789")) + 2 <= len(p) else p
                 for p in name.replace("-", "_").split("_")]
        hits = [i for i, w in enumerate(SMALL_NAMES) if w in parts]
        return (min(hits) if hits else len(SMALL_NAMES), len(name), name)
    return min(names, key=rank)


def timm_entries() -> list[tuple[str, callable]]:
    import timm

    out = []
    for module in sorted(timm.list_modules()):
        names = timm.list_models(module=module)
        if names:
            name = smallest(names)
            out.append((name, lambda name=name: _timm_build(timm, name)))
    return out


def _timm_build(timm, name):
    """The model at 64 px where it takes that size and every patch grid (each stage's) is at least 3×3, else at its
    own; a family whose smallest model is still over :data:`MAX_PARAMETERS` is built with 2
    blocks where it takes ``depth``."""
    built = None
    for size in ({"img_size": 64}, {}):
        for depth in ({}, {"depth": 2}):
            try:
                model = timm.create_model(name, pretrained=False, num_classes=10, **size, **depth)
                if size:  # built at 64 px, but some models then refuse 64 px images (CrossViT's second branch)
                    with torch.no_grad():
                        model.eval()
                        model(torch.zeros(1, 3, 64, 64))
                    grids = [g for m in model.modules()
                             if isinstance(g := getattr(m, "grid_size", None), (tuple, list))]
                    if any(min(g) < 3 for g in grids):  # a stage's patch grid holds no 3×3 kernel: its own size
                        continue
            except Exception:  # a model whose size is fixed, or that takes no depth
                continue
            if depth or sum(p.numel() for p in model.parameters()) <= MAX_PARAMETERS:
                return model
            built = built or model
    return built or timm.create_model(name, pretrained=False)


_SHRINK = {"hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 3,
           "intermediate_size": 192, "image_size": 64, "patch_size": 8, "head_dim": 32, "num_heads": 3,
           "depth": 2, "embed_dim": 96, "vocab_size": 97, "max_position_embeddings": 64,
           "n_embd": 96, "n_layer": 2, "n_head": 3, "n_positions": 64, "n_inner": 192, "num_layers": 2,
           # mixtures of experts: a few small ones (a default count of hundreds fills the memory)
           "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
           "num_experts_per_tok": 2, "moe_topk": 2, "moe_intermediate_size": 96, "n_shared_experts": 1,
           "zero_expert_num": 0, "expert_ffn_hidden_size": 96,
           # encoder-decoder models name their sizes after each side
           "d_model": 96, "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
           "encoder_attention_heads": 3, "decoder_attention_heads": 3, "encoder_ffn_dim": 192,
           "decoder_ffn_dim": 192, "d_ff": 192,
           # a layer inserted after one of the encoder's (MiniCPM-V's merger): within the 2 kept
           "insert_layer_id": 0}


_HEADS = ("num_attention_heads", "num_key_value_heads", "num_heads", "n_head", "encoder_attention_heads",
          "decoder_attention_heads")


def shrink(config, width: int = 96) -> int | None:
    """Every scalar size field of ``config`` and its sub-configs set small (:data:`_SHRINK`,
    widths to ``width``), so each architecture builds in a second: 3 heads of 32 channels at
    width 96; a width 3 does not divide gets 4 heads (width 64: 4 heads of 16). Per-stage widths
    that start at the config's own width (or a sub-config's) are scaled alike. Returns that
    width as the config had it."""
    heads = 3 if width % 3 == 0 else 4
    base = next((v for k, v in vars(config).items() if k in ("hidden_size", "embed_dim") and isinstance(v, int)), None)
    ids = [v for k, v in vars(config).items() if k.endswith("token_id") and isinstance(v, int)]
    sizes = {"head_dim": width // heads, "vocab_size": max([_SHRINK["vocab_size"], *(i + 1 for i in ids)]),
             **{k: heads for k in _HEADS}}
    for key, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            inner = shrink(value, width)
            base = base if base is not None else inner
        elif key in _SHRINK and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, key, width if key in ("hidden_size", "embed_dim", "n_embd", "d_model") else
                    2 * width if key in ("intermediate_size", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
                                         "d_ff") else sizes.get(key, _SHRINK[key]))
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):  # latent attention (DeepSeek's MLA), in scale
        r = width // heads
        for key, value in (("qk_rope_head_dim", r // 2), ("qk_nope_head_dim", r // 2), ("v_head_dim", r),
                           ("head_dim", r // 2), ("kv_lora_rank", r), ("q_lora_rank", width // 2)):
            if isinstance(getattr(config, key, None), int):
                setattr(config, key, value)
    depths, size = getattr(config, "depths", None), getattr(config, "image_size", None)
    if isinstance(depths, (list, tuple)) and isinstance(getattr(config, "window_size", None), int) \
            and isinstance(size, int):
        # windowed stages (Swin) run only while each stage's grid holds a whole window: windows of 4,
        # patches small enough for that at the last stage
        config.window_size = 4
        config.patch_size = max(1, size // (4 * 2 ** (len(depths) - 1)))
        if isinstance(getattr(config, "num_heads", None), (list, tuple)):  # heads that divide each stage's width
            config.num_heads = [heads * 2**i for i in range(len(config.num_heads))]
    for key, value in list(vars(config).items()):  # per-stage widths from the model's own (SAM 2's Hiera): in scale
        if key.endswith(("_per_stage", "channel_list")) and isinstance(value, (list, tuple)) and value \
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and min(value) == base:
            setattr(config, key, type(value)(v * width // base for v in value))
    strides = getattr(config, "strides", None)
    if isinstance(strides, (list, tuple)) and len(strides) > 1 and all(isinstance(v, int) for v in strides) \
            and isinstance(size, (int, tuple, list)):
        # stages each downsampled by their stride (PVT's): an image whose last stage still holds a 3×3 kernel
        side = 4 * math.prod(strides)
        config.image_size = side if isinstance(size, int) else (side, side)
    if hasattr(config, "use_cache"):  # one forward, no generation: a hybrid shrunk to 2 layers may hold no
        config.use_cache = False      # attention layer for its cache to count
    return base


def transformers_entries(width: int = 96, language: bool = True) -> list[tuple[str, callable]]:
    import transformers
    from transformers.models.auto import modeling_auto as auto

    vision = set(auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)
    out = []
    for kind in sorted(transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES):
        try:
            config = transformers.AutoConfig.for_model(kind)
        except Exception:
            continue
        if kind in vision:
            out.append((kind, lambda kind=kind: _hf_build(transformers, kind, width, "classifier")))
        elif getattr(config, "vision_config", None) is not None:
            out.append((f"{kind}.vision", lambda kind=kind: _hf_build(transformers, kind, width, "tower")))
        elif language and kind in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and "vision" not in kind:
            out.append((kind, lambda kind=kind: _hf_build(transformers, kind, width, "language")))
    return out


def _hf_build(transformers, kind, width, role):
    config = transformers.AutoConfig.for_model(kind)
    shrink(config, width)
    if role == "tower":
        return tower_class(config)(config.vision_config)
    auto = transformers.AutoModelForImageClassification if role == "classifier" else transformers.AutoModelForCausalLM
    classes = auto._model_mapping[type(config)]  # several (DeiT's with and without a teacher): the first
    model = (classes[0] if isinstance(classes, (tuple, list)) else classes)(config)
    if role == "language":  # token ids are a language model's one input: a forward that fails on them is
        try:                # the small config's fault (sizes the shrink left inconsistent), not the probe's
            with torch.no_grad():
                model.eval()(torch.randint(0, config.vocab_size, (1, 8)))
        except Exception as err:
            raise RuntimeError(f"its own forward fails on token ids at the small config: {type(err).__name__}: "
                               f"{str(err)[:80]}") from err
    return model


def tower_class(config):
    """The model class that takes ``config.vision_config``: the one ``AutoModel`` maps it to, else
    the class of the family's own modeling module whose ``config_class`` it is (most vision
    configs are not in ``AutoModel``'s map), a ``…VisionModel`` first, abstract bases left out."""
    import importlib
    import inspect

    import transformers

    vision = type(config.vision_config)
    if vision in transformers.models.auto.modeling_auto.MODEL_MAPPING:
        return transformers.models.auto.modeling_auto.MODEL_MAPPING[vision]
    module = importlib.import_module(type(config).__module__.replace("configuration_", "modeling_"))
    found = [c for name, c in sorted(vars(module).items()) if inspect.isclass(c)
             and issubclass(c, transformers.PreTrainedModel) and c.config_class is vision
             and not name.endswith("PreTrainedModel")]
    if not found:
        raise ValueError(f"no model class of {type(config).__module__} takes a {vision.__name__}")
    return min(found, key=lambda c: (not c.__name__.endswith("VisionModel"), len(c.__name__)))


def tower_call(model) -> dict | None:
    """The call of a vision tower as its processor would hand it: packed patches and grid sizes
    (Qwen-VL's ``grid_thw``), one image of 8×8 (else 16×16) patches in the first layout the forward
    takes (:func:`_tower_calls`); a video tower's clip; Pix2Struct's flattened patches; flat patches
    with their places (:func:`_flat_patch_calls`). None for a forward that takes its images alone,
    or whose extra arguments follow another convention (left to the probe, and said)."""
    sig = inspect.signature(model.forward)
    required = [n for n, p in list(sig.parameters.items()) if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    # each image's patch grid: (t, h, w) or (h, w), required or not (the forward then takes images of one size)
    grid = next((n for n in sig.parameters if n.endswith(("grid_thw", "grid_hw")) or n == "target_sizes"), None)
    config = getattr(model, "config", None)
    frames, size = getattr(config, "num_frames", None), getattr(config, "image_size", None)
    if required == ["pixel_values"] and isinstance(frames, int) and isinstance(size, int):
        # a video tower (X-CLIP's): one clip, its frames as a batch of images
        calls = [{"pixel_values": torch.randn(frames, 3, size, size, generator=torch.Generator().manual_seed(0))}]
    elif "pixel_values_videos" in sig.parameters and isinstance(frames, int) and isinstance(size, int):
        # a video tower that takes clips (VideoPrism's): one clip of (frames, C, H, W)
        gen = torch.Generator().manual_seed(0)
        calls = [{"pixel_values_videos": torch.randn(1, frames, 3, size, size, generator=gen)}]
    elif "flattened_patches" in sig.parameters:  # Pix2Struct's: each patch's row and column ids, then its pixels
        calls = _flattened_calls(model)
    elif "pixel_values" in sig.parameters and {"spatial_shapes", "pixel_position_ids"} & set(sig.parameters):
        calls = _flat_patch_calls(model, sig)
    elif not required or grid is None or not set(required) <= {required[0], grid, "merge_sizes"}:
        return None
    else:
        calls = _tower_calls(model, required[0], grid, "merge_sizes" in required)
        images = {required[0]: torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))}
        calls = itertools.chain([images] if grid not in required else [], calls)  # images alone, if it takes them
    was = model.training
    model.eval()
    try:
        for call in calls:
            try:
                with torch.no_grad(), torch.random.fork_rng():
                    model(**call)
            except Exception:  # another layout: the next
                continue
            return call
    finally:
        model.train(was)
    return None


def _flattened_calls(model):
    """Pix2Struct's convention: (1, 64, 2 + C·p·p) patches of an 8×8 grid, each row's first two
    entries its 1-based row and column (0 is padding), the rest the width of the patch
    projection (the first Linear), and an all-ones ``attention_mask``."""
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    rows, cols = torch.meshgrid(torch.arange(1, 9), torch.arange(1, 9), indexing="ij")
    pixels = torch.randn(1, 64, first.in_features, generator=torch.Generator().manual_seed(0))
    ids = torch.stack([rows.reshape(1, -1), cols.reshape(1, -1)], -1).float()
    yield {"flattened_patches": torch.cat([ids, pixels], -1), "attention_mask": torch.ones(1, 64)}


def _flat_patch_calls(model, sig):
    """(1, h·w, C·p·p) patches of an 8×8 (else 12×12, 16×16) grid and their places as the forward names
    them: SigLIP-2's ``spatial_shapes`` and ``pixel_attention_mask``, Gemma 4's (x, y) ``pixel_position_ids``."""
    width = next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features  # C·p·p: the first Linear's
    for side in (8, 12, 16):
        call = {"pixel_values": torch.randn(1, side * side, width, generator=torch.Generator().manual_seed(0))}
        if "spatial_shapes" in sig.parameters:
            call["spatial_shapes"] = torch.tensor([[side, side]])
        if "pixel_attention_mask" in sig.parameters:
            call["pixel_attention_mask"] = torch.ones(1, side * side, dtype=torch.long)
        if "pixel_position_ids" in sig.parameters:  # a row of x first
            y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
            call["pixel_position_ids"] = torch.stack([x.reshape(1, -1), y.reshape(1, -1)], -1)
        yield call


def _tower_calls(model, patches_name: str, grid: str, merge_sizes: bool):
    """Candidate calls, most likely first: patches flat (t·h·w, C·T·p·p) from the config's sizes
    or the width of the tower's first Linear, or as (t·h·w, C, p, p) images for a patch
    convolution, each also with a batch axis in front; merged patches channels last
    (t·h·w / m², p·m, p·m, C) with the grid counted in merged tokens; a row of patches
    (1, C, p, t·h·w·p) (MiniCPM-V's); grids of 8×8 and 16×16 patches, as (t, h, w) or (h, w)."""
    cfg = model.config
    channels = next((v for k in ("in_channels", "num_channels", "in_chans") if (v := getattr(cfg, k, None))), 3)
    patch, frames = getattr(cfg, "patch_size", 14), getattr(cfg, "temporal_patch_size", 1)
    merge = getattr(cfg, "spatial_merge_size", None) or 1
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == m.stride), None)
    shapes = [(channels * frames * patch * patch,)] + ([(first.in_features,)] if first is not None else [])
    if conv is not None:
        shapes.append((conv.in_channels, *conv.kernel_size))
    sizes = (lambda t, h, w: [[t, h, w]]) if grid.endswith("thw") else (lambda t, h, w: [[h, w]])
    for side in (8, 16):
        side = side if side % merge == 0 else side * merge
        gen = lambda: torch.Generator().manual_seed(0)
        layouts = [(torch.randn(side * side, *shape, generator=gen()), side) for shape in dict.fromkeys(shapes)]
        layouts += [(p[None], side) for p, _ in list(layouts)]
        layouts += [(torch.randn(side * side // merge**2, patch * merge, patch * merge, channels, generator=gen()),
                     side // merge), (torch.randn(1, channels, patch, side * side * patch, generator=gen()), side)]
        for patches, counted in layouts:
            call = {patches_name: patches, grid: torch.tensor(sizes(1, counted, counted))}
            if merge_sizes:
                call["merge_sizes"] = torch.tensor([merge])
            yield call


# vit-pytorch's constructors name their sizes alike: each such argument, required or not, takes its value here, a
# prefixed one (``sm_enc_depth``, ``s3_emb_dim``) its suffix's; CCT hands its classifier's on through ``**kwargs``
_VP_FILL = {"image_size": 32, "img_size": 32, "input_shape": 32, "ndim": 2, "patch_size": 4, "num_classes": 10,
            "dim": 64, "depth": 2, "heads": 4, "mlp_dim": 128, "dim_head": 16, "channels": 3, "dropout": 0.0,
            "window_size": 4, "cls_depth": 1, "mlp_mult": 2, "num_hierarchies": 2, "block_repeats": 1,
            "reduction_factor": 2, "num_residual_streams": 2, "num_slots": 4, "max_tokens_per_depth": (48, 32),
            "embedding_dim": 64, "num_layers": 2, "num_heads": 4, "mlp_ratio": 2.0}
# where a name means something else: MobileViT's ``channels`` are its 11 layers' widths, its images (h, w), and its
# 2×2 last map at 32 px holds patches of 1; LookViT's high-res patches must be smaller than its patches
_VP_CLASS_ARGS = {"mobile_vit.MobileViT": {"image_size": (32, 32), "dims": (32, 40, 48), "patch_size": (1, 1),
                                           "channels": (16, 16, 24, 24, 32, 32, 40, 40, 48, 48, 64)},
                  "look_vit.LookViT": {"patch_size": 8, "highres_patch_size": 4}}
# a required argument by these names is a network the class wraps or trains (MAE's encoder, Recorder's vit, ...)
_VP_NETWORKS = ("net", "vit", "encoder", "image_net", "teacher", "student", "transformer", "decoder")
# an argument by these names, required or not, is a time or sequence axis: a 1-D, video or token-sequence model
_VP_AXES = ("seq_len", "sequence_length", "frames", "num_frames", "max_frames", "frame_patch_size", "time_seq_len")


def vit_pytorch_entries() -> list[tuple[str, callable]]:
    """Every 2-D image model class (:func:`_vp_is_image_model`) of every module of vit-pytorch,
    found by walking the package (a new module is swept too), as ``module.ClassName``, built small
    (:func:`_vp_build`). A module that does not import (it needs a package this environment lacks)
    is one row, ``module.*``, that fails to build with the import's error: said, not dropped."""
    import vit_pytorch

    out = []
    for info in pkgutil.walk_packages(vit_pytorch.__path__, "vit_pytorch."):
        short = info.name.removeprefix("vit_pytorch.")
        try:
            module = importlib.import_module(info.name)
        except Exception:
            out.append((f"{short}.*", lambda name=info.name: importlib.import_module(name)))  # raises it again
            continue
        out += [(f"{short}.{name}", lambda cls=cls, key=f"{short}.{name}": _vp_build(cls, key))
                for name, cls in sorted(vars(module).items()) if inspect.isclass(cls) and issubclass(cls, nn.Module)
                and cls.__module__ == info.name and _vp_is_image_model(cls)]
    return out


def _vp_params(cls) -> dict[str, inspect.Parameter]:
    """The constructor's arguments; one of only ``*args, **kwargs`` (DistillableViT's) hands them
    to its base class, whose arguments they then are."""
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            params = dict(list(inspect.signature(klass.__init__).parameters.items())[1:])
            if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
                return params
    return {}


def _vp_is_image_model(cls) -> bool:
    """A model of an image batch: its constructor takes ``num_classes`` (or an image size and
    ``**kwargs`` it hands on, as CCT's), no argument naming a time or sequence axis
    (:data:`_VP_AXES`: 1-D, 3-D and video models, CCT's classifier of token sequences), and no
    required argument naming another network (:data:`_VP_NETWORKS`: wrappers and trainers such as
    MAE, SimMIM, DINO, the distillation wrapper, Extractor, Recorder, learnable memory's Adapter)."""
    params = _vp_params(cls)
    if "num_classes" not in params and not ({"image_size", "img_size"} & set(params)
                                            and any(p.kind is p.VAR_KEYWORD for p in params.values())):
        return False
    return not any(name in _VP_AXES or (name in _VP_NETWORKS and p.default is p.empty) for name, p in params.items())


def _vp_fill(name: str, default):
    """The value :data:`_VP_FILL` gives the argument ``name`` (by its longest known suffix; a
    default of None only by its own name: ``specialize_qkv_depth=None`` stays off), the default
    where it is smaller (entry by entry for a tuple), or None where it names no size."""
    key = next((k for i in range(name.count("_") + 1) if (k := name.split("_", i)[-1]) in _VP_FILL), None)
    if key is None or isinstance(default, bool):
        return None
    value, number = _VP_FILL[key], (int, float)
    if isinstance(value, number) and isinstance(default, number):
        return min(default, value)
    if isinstance(value, number) and isinstance(default, tuple) and all(isinstance(v, number) for v in default):
        return tuple(min(v, value) for v in default)
    return value if default is inspect.Parameter.empty or (default is None and key == name) else None


def _vp_build(cls, key: str = ""):
    """``cls`` built small (:func:`_vp_fill`; one that takes ``**kwargs`` gets every size, for the
    class it hands them to) and run on a (2, 3, 32, 32) batch: a class that fails either is the
    package's to answer for (the sweep's "build-failed"). A class that asks for its depth per
    stage (MaxViT's) is built with two stages of one block."""
    params = _vp_params(cls)
    kwargs = {k: v for k, v in _VP_FILL.items() if k not in params} \
        if any(p.kind is p.VAR_KEYWORD for p in params.values()) else {}
    kwargs |= {name: v for name, p in params.items() if (v := _vp_fill(name, p.default)) is not None}
    kwargs |= _VP_CLASS_ARGS.get(key, {})
    try:
        model = cls(**kwargs)
    except (AssertionError, TypeError) as err:
        if not ("depth" in str(err) and "tuple" in str(err)):
            raise
        model = cls(**{**kwargs, "depth": (1, 1)})
    model.eval()
    try:
        with torch.no_grad():
            model(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    except Exception as err:
        raise RuntimeError(f"forward on (2, 3, 32, 32): {type(err).__name__}: {' '.join(str(err).split())}") from err
    return model
