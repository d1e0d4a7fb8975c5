"""The survey of one model: what structinit reads from it, each fact found once, when first
asked, and asked as often as needed after that.

An init builds one :class:`ModelSurvey` and hands it to its planner and checks; nothing is
kept on the model or in a module-level cache, so a model changed between two inits is read
afresh by the second. The facts:

- :attr:`ModelSurvey.attention`: every attention layer, judged on one probe through the
  model's own forward (:mod:`structinit.adapters.verify`); the probe is the first input the
  model takes (:func:`structinit.adapters.probe.probe_choices`), tried in that same forward;
- :attr:`ModelSurvey.position`: the position embedding, its prefix tokens and grid, by name
  (:mod:`structinit.adapters.position`), checked against and else read from the forward
  (:mod:`structinit.adapters.trace`);
- :meth:`ModelSurvey.relative_bias`: the relative position bias each layer uses.

A scheme that reads none of them (a conv or whole-model scheme) runs no forward at all.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property

import torch
import torch.fx
from torch import nn

from structinit.adapters.fused import FUSED_FUNCTIONS
from structinit.adapters.observe import _MHA, _SOFTMAX
from structinit.adapters.position import Discovery, embedding_rows, named_discovery, prefix_in_layers, square_side
from structinit.adapters.position_mlp import PositionMlpBias, held_position_mlp
from structinit.adapters.probe import ModelCall, _pair, as_call, first_taken, probe_at, probe_choices, probe_tokens
from structinit.adapters.registry import candidate_layers
from structinit.adapters.relative import RelativeBias, find_relative_bias, holds_relative_bias
from structinit.adapters.trace import consistent, traced_discovery
from structinit.adapters.verify import AttentionSurvey, survey_attention


class ModelSurvey:
    """What structinit reads from ``model`` (module doc). Properties compute on first use.

    ``example_inputs`` (a tensor, a tuple of positional arguments or a dict of keyword
    arguments of the model's forward) is the one probe when given: for a model whose input
    structinit cannot build (several arguments, packed patches with their grid sizes). ``grid``,
    the (h, w) patch grid a caller states, adds images of that grid to the probes tried, for an
    image model that states no image size."""

    def __init__(self, model: nn.Module, *, example_inputs=None, grid=None):
        self.model = model
        self.example = None if example_inputs is None else as_call(example_inputs)
        self.grid = _pair(grid)

    def _probes(self, candidates):
        if self.example is not None:
            yield self.example
            return
        yield from probe_choices(self.model, candidates)
        if self.grid is not None and (at := probe_at(self.model, self.grid)) is not None:
            yield at
        if candidates:  # a model that takes tokens, not images
            yield from probe_tokens(self.model, candidates[0][1].dim, self.grid)

    @cached_property
    def _candidates(self):
        return candidate_layers(self.model)

    @property
    def candidates(self) -> list[tuple[str, object]]:
        """(name, adapter) of every module an attention adapter claims, by names and shapes
        alone (no forward; :func:`structinit.adapters.registry.candidate_layers`)."""
        return self._candidates[0]

    @cached_property
    def attention(self) -> AttentionSurvey:
        """Every claimed attention layer judged against the model's own forward on a probe:
        self-attention, pooling heads, layers whose computation differs from their adapter's,
        and attention no adapter claims."""
        candidates, named_unknown = self._candidates
        survey = survey_attention(self.model, candidates, self._probes(candidates))
        if self.example is not None and not survey.probed:
            raise ValueError(f"example_inputs: {type(self.model).__name__}'s forward does not take it "
                             f"({_failure(self.model, self.example)}); pass what its forward takes: a tensor, a "
                             "tuple of positional arguments or a dict of keyword arguments")
        # Without a probe the class names are all there is to go by; with one, the dataflow decides.
        extra = [] if survey.probed else [(n, t if ":" in t else f"{t}: its class name says attention")
                                          for n, t in named_unknown]
        return dataclasses.replace(survey, unknown=[*survey.unknown, *extra]) if extra else survey

    @property
    def probe(self) -> torch.Tensor | ModelCall | None:
        """The probe the model took: (1 or 2, C, H, W) images, (2, T) token ids or the caller's
        :class:`~structinit.adapters.probe.ModelCall`; None if none."""
        return self.attention.probe

    @property
    def takes_token_ids(self) -> bool:
        """Whether the model is probed with token ids (a 1-D sequence) rather than images."""
        main = self.probe.main if isinstance(self.probe, ModelCall) else self.probe
        return main is not None and not main.is_floating_point()

    def layers(self, *, pooling: bool = False) -> list[tuple[str, object]]:
        """The attention layers in definition order, as (name, adapter); see
        :func:`find_attention_layers`."""
        survey = self.attention
        unrun = "" if survey.probed else (
            f". structinit could not run {type(self.model).__name__}'s forward on any input it can build (images, "
            "token ids) to read what it computes: pass example_inputs= what the forward takes (a tensor, a "
            "tuple of positional arguments or a dict of keyword arguments)")
        if unknown := survey.unknown:
            raise ValueError(
                "found attention that no adapter understands: "
                + ", ".join(f"{n or '<root>'} ({what})" for n, what in unknown) + unrun
                + ". Supported: any module whose forward is softmax(q kᵀ·scale + bias)·v of its own projections "
                "(read from what it computes), nn.MultiheadAttention, ConViT's gated positional attention. "
                "Register your class with structinit.register_adapter(YourAttention, factory)."
            )
        found = [(v.name, v.adapter) for v in survey.verdicts if v.kind != "pooling" or pooling]
        if not found:
            raise ValueError(self._none_found(unrun))
        return found

    def _none_found(self, unrun: str) -> str:
        """Why :meth:`layers` found no layer to initialise: none at all, only pooling heads, or
        only softmax maps it cannot read (named, as a model with attention, not one without)."""
        survey, types = self.attention, sorted({type(m).__name__ for m in self.model.modules()})
        skipped = survey.skipped()
        also = (f" (only layers it leaves alone: {', '.join(n for n, _ in skipped)}, the first as {skipped[0][1]}; "
                "pass pooling=True to include those an adapter understands)") if skipped else ""
        if survey.unread:
            return (f"no attention layer structinit can read in {type(self.model).__name__}{also}: its forward makes "
                    "softmax maps that are neither self-attention over its tokens nor pooling by its adapters: "
                    + ", ".join(f"{n} ({what})" for n, what in survey.unread[:3])
                    + ". Register an adapter for it (structinit.register_adapter) if it is attention")
        return (f"no attention layer found in {type(self.model).__name__}{also} (module types: {', '.join(types)})"
                f"{unrun}. structinit initialises self-attention; register an adapter with "
                "structinit.register_adapter(YourAttention, factory) if your model has one.")

    @cached_property
    def first_layer(self) -> tuple[str, object] | None:
        """(name, adapter) of the first attention layer, or None when there is none to read."""
        try:
            return self.layers()[0]
        except ValueError:
            return None

    @cached_property
    def first_layer_tokens(self) -> int | None:
        """How many tokens the first attention layer received in the probe, or None."""
        first = self.first_layer
        verdict = None if first is None else self.attention.verdict(first[0])
        return None if verdict is None else verdict.tokens

    @cached_property
    def position(self) -> Discovery:
        """The position embedding, prefix tokens and grid: the first finder's, unless the forward
        shows otherwise (module doc); an empty :class:`Discovery` when nothing is found."""
        found = _grid_of_rows(named_discovery(self.model))
        if found.source == "none" or (found.source == "generic" and not consistent(found, self.first_layer_tokens)):
            found = traced_discovery(self) or found
        found = prefix_in_layers(found, self.first_layer_tokens)
        if not _fits(found, self.first_layer_tokens):  # resized to each image's grid (NaFlexViT): read on the probe
            again = traced_discovery(self, on_probe=True)
            again = None if again is None else prefix_in_layers(again, self.first_layer_tokens)
            found = again if again is not None and _fits(again, self.first_layer_tokens) else found
        return found

    def stage_position(self, name: str, adapter) -> Discovery | None:
        """The position embedding of attention layer ``name``'s own tokens, traced from that layer
        (:func:`~structinit.adapters.trace.traced_discovery`): a later stage's, added after a
        pooling or a merge (Visformer's, CrossViT's second branch); None when none is there. Traced
        once per stage: the layers of one width and token count share it."""
        verdict = self.attention.verdict(name)
        tokens = verdict and verdict.tokens
        key = (adapter.dim, tokens)
        if key not in self._stage_positions:
            found = traced_discovery(self, layer=(name, adapter))
            self._stage_positions[key] = None if found is None else prefix_in_layers(found, tokens)
        return self._stage_positions[key]

    @cached_property
    def _stage_positions(self) -> dict[tuple[int, int | None], Discovery | None]:
        return {}

    def relative_bias(self, name: str, adapter) -> RelativeBias | PositionMlpBias | None:
        """The relative position bias attention layer ``name`` uses: its own
        (``adapter.relative``), else one its block holds beside it and hands it with each call
        (Hugging Face's BEiT), else the only one the model holds outside its attention layers
        (timm's BEiT with ``use_shared_rel_pos_bias``, timm's relpos ViTs with ``shared_rel_pos``,
        whose bias an MLP generates); None if there is none."""
        if adapter.relative is not None:
            return adapter.relative
        parent = self.model.get_submodule(name.rpartition(".")[0]) if name else None
        siblings = [] if parent is None else [c for c in parent.children() if c is not adapter.module]
        for child in siblings:
            if (found := _received(child)) is not None:
                return found
        return self._shared_bias

    @cached_property
    def _shared_bias(self) -> RelativeBias | PositionMlpBias | None:
        inside = {id(m) for _, ad in self.candidates for m in ad.module.modules()}
        outside = [m for m in self.model.modules() if id(m) not in inside
                   and (holds_relative_bias(m) or held_position_mlp(m) is not None)]
        return _received(outside[0]) if len(outside) == 1 else None


def _grid_of_rows(found: Discovery) -> Discovery:
    """``found`` with the square grid of its PE's rows in place of a grid its finder named that
    those rows do not fill (a config's image size over its patch size, for patches that overlap:
    Hugging Face's Hiera cuts 7-pixel patches at stride 4, 56×56 of them at 224 px, not 32×32)."""
    rows, prefix = embedding_rows(found), found.num_prefix_tokens or 0
    if rows is None or found.grid is None or rows in (math.prod(found.grid), math.prod(found.grid) + prefix):
        return found
    side = square_side(rows - prefix) or (square_side(rows) if prefix else None)
    return dataclasses.replace(found, grid=(side, side)) if side else found


def _fits(found: Discovery, tokens: int | None) -> bool:
    """Whether the prefix tokens and grid ``found`` gives add up to the first layer's ``tokens``
    (True when either is unknown)."""
    rows = embedding_rows(found)
    if tokens is None or rows is None:
        return True
    prefix = found.num_prefix_tokens or 0
    cells = found.grid[0] * found.grid[1] if found.grid is not None else rows if square_side(rows) else rows - prefix
    return prefix + cells == tokens


def _failure(model: nn.Module, call: ModelCall) -> str:
    """What ``model``'s forward raises on ``call``, run as every probe is (:func:`first_taken`)."""
    errors = []
    if first_taken(model, [call], errors) is not None:
        return "its forward ran, but structinit saw no attention in it"
    return f"{type(errors[0]).__name__}: {str(errors[0])[:200]}"


def as_survey(model: nn.Module | ModelSurvey) -> ModelSurvey:
    """``model``'s survey: itself when it is one, else a new one."""
    return model if isinstance(model, ModelSurvey) else ModelSurvey(model)


def _received(holder: nn.Module) -> RelativeBias | PositionMlpBias | None:
    """The bias ``holder`` itself holds, marked as handed to the layer with its call; None if none."""
    if not holds_relative_bias(holder):
        return held_position_mlp(holder)
    return dataclasses.replace(find_relative_bias(holder), received=True)


def attention_survey(model: nn.Module | ModelSurvey) -> AttentionSurvey:
    """The model's attention as one probe through its own forward shows it
    (:attr:`ModelSurvey.attention`)."""
    return as_survey(model).attention


def find_attention_layers(model: nn.Module | ModelSurvey, *, pooling: bool = False) -> list[tuple[str, object]]:
    """The attention layers of ``model`` in definition order, as (name, adapter).

    Layers are found by their adapters, and by what the model computes for attention no adapter
    claims (:mod:`structinit.adapters.provenance`), and checked against one probe through the
    model's own forward. Attention-pooling and class-attention heads (fewer queries than keys)
    are left out unless ``pooling=True``. Layers whose forward differs from their adapter's
    view are kept: each scheme decides whether it can set them. Raises ValueError if there is
    no attention layer, or if the model has attention that cannot be read.
    """
    return as_survey(model).layers(pooling=pooling)


def find_position_embedding(model: nn.Module | ModelSurvey) -> Discovery:
    """The model's position embedding, prefix tokens and grid (:attr:`ModelSurvey.position`)."""
    return as_survey(model).position


def layer_relative_bias(model: nn.Module | ModelSurvey, name: str, adapter) -> RelativeBias | PositionMlpBias | None:
    """The relative position bias attention layer ``name`` uses (:meth:`ModelSurvey.relative_bias`)."""
    return as_survey(model).relative_bias(name, adapter)


def forms_no_attention(model: nn.Module) -> bool:
    """Whether ``model`` provably forms no attention map, read without running it: its torch.fx
    graph (a symbolic trace: Python runs on placeholders, no tensor is computed and nothing in
    the model changes) calls no softmax, fused attention (``scaled_dot_product_attention``,
    ``flex_attention``) or multi-head attention, and no module holding ``nn.MultiheadAttention``
    or ``nn.Softmax``. False whenever that cannot be told so (a forward whose Python branches on
    its tensors does not trace): ask the forward."""
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # dynamic control flow, unusual inputs: no proof
        return False
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (*_SOFTMAX, *FUSED_FUNCTIONS, _MHA):
            return False
        if node.op == "call_method" and node.target == "softmax":
            return False
        if node.op == "call_module" and any(isinstance(m, (nn.MultiheadAttention, nn.Softmax))
                                            for m in model.get_submodule(node.target).modules()):
            return False
    return True
