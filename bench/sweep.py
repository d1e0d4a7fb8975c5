"""The registry sweep: structinit's attention inits, with no hints, on one small model of every
module family of timm and every vision architecture of transformers (image classifiers and the
vision towers of multimodal models), and on transformers' language models for mimetic. Per
model × scheme: the outcome, the model's own maps after the write, and the reason of a refusal.

    .venv-zoo/bin/python bench/sweep.py --packages timm,transformers --out sweep.json
    .venv-zoo/bin/python bench/sweep.py --from sweep.json          # the table again, from the data

A vision tower whose forward takes packed patches and their grid sizes is handed one call of
it (``example_inputs=``, :func:`tower_call`), as a user with its processor would; every other
model gets no hints. A timm family still over :data:`MAX_PARAMETERS` at its smallest is built
with 2 blocks where it takes ``depth``.

A written init is checked on the maps the model computes itself: impulse's argmax hit on the
position-only input (``structinit.impulse_fidelity(model)``), mimetic's diagonal strength in the
model's own logits on a probe (its softmax's input, else its log-probabilities). "silent" is a write whose own maps
miss (hit < 0.95, or a diagonal strength < 0.5 in some head). A refusal is "expected" when its
reason names a mechanism no init of its kind can shape (:data:`MECHANISMS`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import sys
import traceback
import warnings
from dataclasses import asdict, dataclass

import torch
from torch import nn

SCHEMES = ("impulse", "mimetic")
# Refusal reasons that name what the scheme cannot realise on that layer, by words in the message.
MECHANISMS = {
    "impulse": ("reads token ids", "grouped-query", "no softmax(q kᵀ) map", "linear or factorised",
                "q and k are normalised", "rotated by position", "masks each token's logit on itself",
                "no attention layer found", "tokens carry no position", "without biasing other pairs",
                "not self-attention over its tokens"),
    "mimetic": ("no softmax(q kᵀ) map", "linear or factorised", "no attention layer found",
                "not self-attention over its tokens"),
}
MAX_PARAMETERS = 60_000_000  # larger models take minutes a forward on a CPU core: skipped, and said so
SMALL_NAMES = ("atto", "femto", "pico", "nano", "tiny", "ti", "t", "micro", "mini", "small", "xxs", "xs", "s")


@dataclass
class Row:
    model: str
    package: str
    scheme: str
    outcome: str  # written, silent, unverified, refused, expected, traceback, no-attention, too-large, build-failed
    own_map: float | None = None
    reason: str = ""
    call: str = ""  # the forward's arguments the sweep handed over as example_inputs, when images do not do


class _Timeout(BaseException):  # not an Exception: the code under test must not swallow it
    pass


def _alarm(signum, frame):
    raise _Timeout


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
    """The model at 64 px where it takes that size, else at its own; a family whose smallest
    model is still over :data:`MAX_PARAMETERS` is built with 2 blocks where it takes ``depth``."""
    built = None
    for size in ({"img_size": 64}, {}):
        for depth in ({}, {"depth": 2}):
            try:
                model = timm.create_model(name, pretrained=False, num_classes=10, **size, **depth)
                if size:  # built at 64 px, but some models then refuse 64 px images (CrossViT's second branch)
                    with torch.no_grad():
                        model.eval()
                        model(torch.zeros(1, 3, 64, 64))
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
           "decoder_ffn_dim": 192, "d_ff": 192}


_HEADS = ("num_attention_heads", "num_key_value_heads", "num_heads", "n_head", "encoder_attention_heads",
          "decoder_attention_heads")


def shrink(config, width: int = 96) -> None:
    """Every scalar size field of ``config`` and its sub-configs set small (:data:`_SHRINK`,
    widths to ``width``), so each architecture builds in a second: 3 heads of 32 channels at
    width 96; a width 3 does not divide gets 4 heads (width 64: 4 heads of 16)."""
    heads = 3 if width % 3 == 0 else 4
    ids = [v for k, v in vars(config).items() if k.endswith("token_id") and isinstance(v, int)]
    sizes = {"head_dim": width // heads, "vocab_size": max([_SHRINK["vocab_size"], *(i + 1 for i in ids)]),
             **{k: heads for k in _HEADS}}
    for key, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            shrink(value, width)
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
    if hasattr(config, "use_cache"):  # one forward, no generation: a hybrid shrunk to 2 layers may hold no
        config.use_cache = False      # attention layer for its cache to count


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
    """The call of a vision tower whose forward takes each image's patches packed into one
    sequence and their grid sizes (Qwen-VL's convention: ``grid_thw`` = [[t, h, w]] and the
    patches, flat or as small images), as its processor would hand it: one image of 8×8 (else
    16×16) patches, the first layout the forward takes (:func:`_tower_calls`). None for a
    forward that takes its images alone, or whose extra arguments follow another convention
    (left to the probe, and said)."""
    sig = inspect.signature(model.forward)
    required = [n for n, p in list(sig.parameters.items()) if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    grid = next((n for n in required if n.endswith("grid_thw")), None)
    if {"pixel_values", "spatial_shapes"} <= set(sig.parameters):  # NaViT's: padded patches and each image's h, w
        calls = _navit_calls(model, "pixel_attention_mask" in sig.parameters)
    elif len(required) < 2 or grid is None or not set(required) <= {required[0], grid, "merge_sizes"}:
        return None
    else:
        calls = _tower_calls(model, required[0], grid, "merge_sizes" in required)
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


def _navit_calls(model, mask: bool):
    """SigLIP-2's convention: (1, h·w, C·p·p) patches, ``spatial_shapes`` [[h, w]] and an
    all-ones ``pixel_attention_mask``, for 8×8 patches (the width of the first Linear)."""
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    call = {"pixel_values": torch.randn(1, 64, first.in_features, generator=torch.Generator().manual_seed(0)),
            "spatial_shapes": torch.tensor([[8, 8]])}
    if mask:
        call["pixel_attention_mask"] = torch.ones(1, 64, dtype=torch.long)
    yield call


def _tower_calls(model, patches_name: str, grid: str, merge_sizes: bool):
    """Candidate calls, most likely first: patches flat (t·h·w, C·T·p·p) from the config's sizes
    or the width of the tower's first Linear, or as (t·h·w, C, p, p) images for a patch
    convolution; grids of 8×8 and 16×16 patches."""
    cfg = model.config
    channels = next((v for k in ("in_channels", "num_channels", "in_chans") if (v := getattr(cfg, k, None))), 3)
    patch, frames = getattr(cfg, "patch_size", 14), getattr(cfg, "temporal_patch_size", 1)
    merge = getattr(cfg, "spatial_merge_size", 1)
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == m.stride), None)
    shapes = [(channels * frames * patch * patch,)] + ([(first.in_features,)] if first is not None else [])
    if conv is not None:
        shapes.append((conv.in_channels, *conv.kernel_size))
    for side in (8, 16):
        side = side if side % merge == 0 else side * merge
        for shape in dict.fromkeys(shapes):
            gen = torch.Generator().manual_seed(0)
            patches = torch.randn(side * side, *shape, generator=gen)
            call = {patches_name: patches, grid: torch.tensor([[1, side, side]])}
            if merge_sizes:
                call["merge_sizes"] = torch.tensor([merge])
            yield call


def own_map(model, scheme: str, call: dict | None = None) -> float:
    """The write as the model's own maps show it (module doc): impulse's smallest head hit on
    the position-only input; for mimetic, the smallest ratio, over the heads whose written q kᵀ
    has a diagonal strength of at least 1 on a probe (a layer with none counts 1 when its maps
    are those of the written q kᵀ within 1e-3, else 0), of the strength in the model's own logits
    (its softmax's input; the log-probabilities where that cannot be read, floored at 1e-30 so
    that a masked pair is a very low logit, as in its softmax, not −∞) to the written one (a head
    whose truncation leaves no diagonal promises none)."""
    import structinit
    from structinit.adapters.observe import map_rows, observe, real_maps
    from structinit.adapters.survey import ModelSurvey
    from structinit.adapters.verify import adapter_logits
    from structinit.schemes.checks import diagonal_strength

    survey = ModelSurvey(model, example_inputs=call)  # the probe the init's own survey takes, and its layers
    if scheme == "impulse":
        return float(torch.nan_to_num(structinit.impulse_fidelity(survey)["hit"], nan=1.0).min())
    layers, inputs = survey.layers(), survey.probe
    calls, _ = observe(model, inputs, [(ad.module, ad.input_module, ad) for _, ad in layers])
    ratios = []
    for (_, ad), real in zip(layers, real_maps(model, inputs, layers, calls)):
        call = calls[ad.module]
        x = map_rows(call.x, real.probs.shape[-1], real.probs.shape[0])
        if x is None or x.shape[-2] < 3:
            continue
        with torch.no_grad():
            logits = adapter_logits(ad, x.float(), ad.call_terms(call.args, call.kwargs, x))
        written = diagonal_strength(logits)
        own = diagonal_strength(real.logits.float() if real.logits is not None
                                else real.probs.float().clamp_min(1e-30).log())
        ratios += [float(own[h] / written[h]) for h in range(len(written)) if written[h] >= 1.0]
        if not bool((written >= 1.0).any()):  # no diagonal to measure: the maps must be the written q kᵀ's
            gap = float((real.probs.float() - logits.softmax(-1).reshape(real.probs.shape)).abs().max())
            ratios.append(1.0 if gap <= 1e-3 else 0.0)
    if not ratios:
        raise ValueError("no head has a written diagonal to check, on maps of 3 or more keys")
    return min(ratios)


def run_one(name: str, package: str, build, schemes=SCHEMES, seconds: int = 120) -> list[Row]:
    import structinit
    from structinit.adapters.survey import attention_survey

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        torch.manual_seed(0)
        model = build().eval()
        size = sum(p.numel() for p in model.parameters())
        if size > MAX_PARAMETERS:  # the family's smallest entry point is still large: a CPU sweep skips it
            return [Row(name, package, s, "too-large", reason=f"{size / 1e6:.0f}M parameters") for s in schemes]
        survey = attention_survey(model)
        if not (survey.verdicts or survey.unknown or survey.pooling):
            return [Row(name, package, s, "no-attention") for s in schemes]
        call = tower_call(model) if package == "transformers" else None
        return [_one_scheme(structinit, model, name, package, scheme, call) for scheme in schemes]
    except _Timeout:
        return [Row(name, package, s, "timeout", reason=f"over {seconds} s") for s in schemes]
    except Exception as err:  # the package could not build it small: not structinit's to judge
        return [Row(name, package, s, "build-failed", reason=f"{type(err).__name__}: {str(err)[:120]}")
                for s in schemes]
    finally:
        signal.alarm(0)


def _one_scheme(structinit, model, name, package, scheme, call: dict | None = None) -> Row:
    import copy

    target = copy.deepcopy(model)
    given = {} if call is None else {"example_inputs": call}
    said = ", ".join(given.get("example_inputs", {}))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            structinit.init_(target, scheme, seed=0, **given)
    except ValueError as err:
        reason = str(err).split("; nothing was written")[0][:300]
        expected = any(words in str(err) for words in MECHANISMS[scheme])
        return Row(name, package, scheme, "expected" if expected else "refused", reason=reason, call=said)
    except _Timeout:
        raise
    except Exception as err:
        where = traceback.extract_tb(err.__traceback__)[-1]
        return Row(name, package, scheme, "traceback", call=said,
                   reason=f"{type(err).__name__}: {str(err)[:160]} ({where.filename.split('/')[-1]}:{where.lineno})")
    try:
        score = own_map(target, scheme, call)
    except Exception as err:  # written, but its maps cannot be read: not verified, and said so
        why = f"own maps unreadable: {type(err).__name__}: {err}"
        return Row(name, package, scheme, "unverified", reason=why[:200], call=said)
    ok = score >= (0.95 if scheme == "impulse" else 0.5)
    return Row(name, package, scheme, "written" if ok else "silent", score, call=said)


def summary(rows: list[Row]) -> str:
    counted = [r for r in rows if r.outcome not in ("no-attention", *_UNMEASURED)]
    good = sum(r.outcome in ("written", "expected") for r in counted)
    silent = sum(r.outcome == "silent" for r in counted)
    tracebacks = sum(r.outcome == "traceback" for r in counted)
    unverified = sum(r.outcome == "unverified" for r in counted)
    return (f"sweep: {good}/{len(counted)} as expected, {silent} silent, {tracebacks} tracebacks "
            f"({unverified} written with no map of 3 or more keys to check)")


def group_of(row: Row) -> str:
    """The table's group of a row: timm, or transformers' image classifiers, vision towers and
    language models (as :func:`transformers_entries` builds them)."""
    if row.package != "transformers":
        return row.package
    if row.model.endswith(".vision"):
        return "transformers: vision towers"
    from transformers.models.auto import modeling_auto as auto

    classifier = row.model in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    return f"transformers: {'image classifiers' if classifier else 'language models'}"


def summary_table(rows: list[Row]) -> str:
    """Markdown, one line per group (:func:`group_of`): families with attention, and per scheme
    how many behave as expected (written on their own maps, or refused for a mechanism), silent
    writes, tracebacks, writes with no map to check, the families called with an example input
    (:func:`tower_call`), and those not measured (the package could not build them small, or
    they are too large for a CPU sweep)."""
    lines = ["| package | families with attention | " + " | ".join(f"{s} as expected" for s in SCHEMES)
             + " | silent | tracebacks | written, no map to check | called with example_inputs"
             " | not built or too large |",
             "|---|" + "---:|" * (len(SCHEMES) + 6)]
    for group in dict.fromkeys(group_of(r) for r in rows):
        mine_all = [r for r in rows if group_of(r) == group]
        counted = [r for r in mine_all if r.outcome not in ("no-attention", *_UNMEASURED)]
        cells = []
        for scheme in SCHEMES:
            mine = [r for r in counted if r.scheme == scheme]
            written = sum(r.outcome == "written" for r in mine)
            expected = sum(r.outcome == "expected" for r in mine)
            cells.append(f"{written + expected} ({written} written, {expected} refused for the mechanism)")
        called = len({r.model for r in counted if r.call})
        unmeasured = len({r.model for r in mine_all if r.outcome in _UNMEASURED})
        lines.append(f"| {group} | {len({r.model for r in counted})} | " + " | ".join(cells) + " | "
                     + " | ".join(str(sum(r.outcome == o for r in counted)) for o in ("silent", "traceback",
                                                                                     "unverified"))
                     + f" | {called} | {unmeasured} |")
    return "\n".join(lines)


_UNMEASURED = ("build-failed", "timeout", "too-large")


def table(rows: list[Row]) -> str:
    lines = ["| model | package | scheme | outcome | own-map | reason |", "|---|---|---|---|---:|---|"]
    for r in rows:
        score = "" if r.own_map is None else f"{r.own_map:.2f}"
        given = f" (called with example_inputs: {r.call})" if r.call else ""
        lines.append(f"| {r.model} | {r.package} | {r.scheme} | {r.outcome} | {score} | "
                     f"{r.reason.replace('|', '/')}{given} |")
    per = {p: summary([r for r in rows if r.package == p]) for p in dict.fromkeys(r.package for r in rows)}
    return "\n".join(lines + [""] + [f"{p}: {s}" for p, s in per.items()] + [summary(rows)])


def _save(path: str, rows: list[Row]) -> None:
    """Atomically: a sweep killed while writing keeps its last complete file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"rows": [asdict(r) for r in rows]}, f, indent=0)
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packages", default="timm,transformers")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--width", type=int, default=96, help="transformers' hidden size")
    parser.add_argument("--only", default="", help="comma-separated model names to run")
    parser.add_argument("--skip", default="", help="comma-separated model names to leave out (said in the table)")
    parser.add_argument("--out", help="write the rows as JSON here (and resume from it)")
    parser.add_argument("--from", dest="source", help="print the table of a saved sweep")
    parser.add_argument("--summary", action="store_true", help="with --from: one line per package and kind")
    args = parser.parse_args(argv)
    if args.source:
        saved = [Row(**r) for r in json.load(open(args.source))["rows"]]
        print(summary_table(saved) if args.summary else table(saved))
        return 0
    schemes = tuple(args.schemes.split(","))
    done: dict[tuple[str, str], list[Row]] = {}
    if args.out and os.path.exists(args.out):  # a sweep stopped midway resumes where it was
        for r in json.load(open(args.out))["rows"]:
            done.setdefault((r["model"], r["package"]), []).append(Row(**r))
    entries = []
    for package in args.packages.split(","):
        found = timm_entries() if package == "timm" else transformers_entries(args.width)
        entries += [(name, package, build) for name, build in found]
    only, skip = set(filter(None, args.only.split(","))), set(filter(None, args.skip.split(",")))
    rows = []
    for name, package, build in entries:
        if only and name not in only:
            continue
        if name in skip:
            rows += [Row(name, package, s, "too-large", reason="left out with --skip") for s in schemes]
            continue
        got = done.get((name, package)) or run_one(name, package, build, schemes)
        rows += got
        print(" | ".join(f"{r.model} {r.scheme}: {r.outcome}" for r in got), file=sys.stderr, flush=True)
        if args.out:
            _save(args.out, rows)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
