"""Reading a finished run back: its configuration, its results, its model as it was at
initialisation and as training left it. Used by the analysis commands (attention maps
before/after training, CKA, reports); every failure names the folder or file and what was
expected there."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from structinit.harness.config import config_from_dict
from structinit.harness.run.checkpoint import (
    WEIGHTS,
    init_fingerprint,
    load_weights,
    result_digest,
    run_id,
    state_digest,
    weights_metadata,
)
from structinit.harness.run.folder import comparison_in
from structinit.harness.run.lifecycle import RESULT
from structinit.harness.tasks import Kind, kind_of
from structinit.harness.tasks.image import plan_model

# The classifier's weight in the models the harness trains (ViT and Mixer, Swin, …), first match wins.
HEAD_KEYS = ("head.weight", "head.fc.weight", "fc.weight", "classifier.weight")


@dataclass(frozen=True)
class FinishedRun:
    """A run folder with a ``result.json``: where it is, its result and its config."""

    path: Path
    result: dict[str, Any]

    @property
    def kind(self) -> Kind:
        """What the run trained on (:data:`structinit.harness.tasks.KINDS`)."""
        return kind_of(self.result)

    @property
    def config(self):
        """The run's config (a ImageConfig, or a SequenceConfig for a sequence-task run)."""
        return config_from_dict(self.kind.config, self.result["config"])

    @property
    def num_classes(self) -> int:
        """Classes of the run's model, read from the head (:data:`HEAD_KEYS`) of its final weights."""
        weights = self.path / WEIGHTS
        tensors, _ = load_weights(weights)
        head = next((tensors[k] for k in HEAD_KEYS if k in tensors), None)
        if head is None:
            raise ValueError(f"{weights}: none of {', '.join(HEAD_KEYS)}, so the number of classes is unknown")
        return int(head.shape[0])

    @property
    def spec(self) -> str:
        """The init spec the run was trained with, ``<init>[:options]``, as a comparison names it."""
        cfg = self.result["config"]
        options = ",".join(f"{k}={v}" for k, v in cfg.get("init_options", {}).items())
        return f"{cfg['init']}{':' + options if options else ''}"

    @property
    def label(self) -> str:
        """``<init>[:options] seed <k>``, as a comparison names it."""
        return f"{self.spec} seed {self.result['config']['seed']}"


def load_run(path: str | Path) -> FinishedRun:
    """The finished run in ``path``; a clear error if it is not one (no folder, no
    ``result.json``, or one that is not a structinit result)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"run folder {path} does not exist (or is not a folder); pass the folder that "
                                f"`structinit train --out` wrote")
    result_path = path / RESULT
    if not result_path.is_file() and (why := comparison_in(path)):
        runs = sorted(p.parent for p in path.glob(f"*/seed*/{RESULT}"))
        example = f", such as {runs[0]}" if runs else ""
        raise ValueError(f"{path} is a comparison's folder ({why}), not a run; pass one of its runs{example}")
    if not result_path.is_file():
        raise FileNotFoundError(f"{path} has no {RESULT}: it is not a finished run (it may still be training, or "
                                "have been killed: finish it with `structinit train --resume --out` first)")
    try:
        result = json.loads(result_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{result_path}: not readable JSON ({err}); expected the result file a run writes") from err
    missing = [k for k in ("config", "final", "history", "seed") if not isinstance(result, dict) or k not in result]
    if missing:
        raise ValueError(f"{result_path}: not a structinit result (missing {', '.join(missing)})")
    _check_own(result_path, result)
    return FinishedRun(path, result)


def _check_own(result_path: Path, result: dict) -> None:
    """A result.json that is its own run's: as the run wrote it (its digest), its run id the one
    its config, starting weights and data make (not edited), the run id of the weights beside it
    (not copied from another run's folder), and in a comparison's ``seed<N>`` folder seed N's. A
    result written before run ids (or before its digest) is not checked so."""
    rewrite = f"`structinit train --resume --out {result_path.parent}` writes it again from the run's checkpoint"
    folder = re.fullmatch(r"seed(\d+)", result_path.parent.name)
    if folder and result.get("seed") != int(folder[1]):
        raise ValueError(f"{result_path}: it is seed {result.get('seed')}'s result, in the folder of seed "
                         f"{folder[1]}: a copy from another run; {rewrite}")
    recorded = result.get("run_id")
    if recorded is None:
        return
    free = getattr(kind_of(result).task, "free_fields", ())
    made = run_id(result["config"], result.get("init_fingerprint", ""), result.get("data", {}), free)
    if made != recorded:
        raise ValueError(f"{result_path}: its settings, seed or data are not those of run {recorded}, which it "
                         f"names (edited by hand, or put together from two runs); {rewrite}")
    digest = result.get("result_sha256")
    if digest is not None and result_digest(result) != digest:
        raise ValueError(f"{result_path}: it is not the file its run wrote (its scores were changed since: its "
                         f"result_sha256 no longer matches); {rewrite}")
    weights = result_path.parent / WEIGHTS
    if weights.is_file():  # the header alone: the weights beside it are the same run's (not copied in)
        _check_header(weights, weights_metadata(weights), result)


def find_runs(folder: str | Path, depth: int = 2, required: bool = True) -> list[FinishedRun]:
    """Every finished run in ``folder`` or up to ``depth`` folders below it (a comparison keeps
    them in ``<init>/seed<k>``, an ablation in ``runs/<variant>/<init>/seed<k>``), deepest
    first, in sorted path order; an error if there is none and ``required``."""
    folder = Path(folder).expanduser()
    if (folder / RESULT).is_file():
        return [load_run(folder)]
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist (or is not a folder); pass a run or comparison folder")
    runs = [load_run(p.parent) for d in range(depth, 0, -1) for p in sorted(folder.glob("*/" * d + RESULT))]
    if not runs and required:
        raise FileNotFoundError(f"{folder} holds no finished run (no {RESULT} in it or in <init>/seed<k>/ below it)")
    return runs


def models_of(run: FinishedRun, image_shape: tuple[int, int, int], num_classes: int) -> tuple[nn.Module, nn.Module]:
    """(model at initialisation, trained model) of ``run``: the init rebuilt from its config
    exactly as training made it (checked against the recorded fingerprint), and the same
    architecture with the run's final weights (``model.safetensors``) loaded strictly."""
    cfg = run.config
    initial, plan = plan_model(cfg, image_shape, num_classes)
    plan.commit()
    recorded = run.result.get("init_fingerprint")
    if recorded and init_fingerprint(initial) != recorded:
        raise ValueError(f"{run.path}: the init rebuilt from its config differs from the one it trained from (the "
                         "init's code or defaults changed since); its before/after comparison would be wrong")
    trained = copy.deepcopy(initial)  # the same architecture, without solving the init again
    load_trained_weights(trained, run.path / WEIGHTS, init_fingerprint=recorded, result=run.result)
    return initial, trained


_REWRITE = ("delete it and run `structinit train --resume --out <the run's folder>`, which exports the run's own "
            "weights again from its checkpoint")


def load_trained_weights(model: nn.Module, path: Path, init_fingerprint: str | None = None,
                         result: dict | None = None) -> None:
    """Load ``path`` into ``model``; a ValueError naming the missing, unexpected or misshapen
    keys if the file holds another architecture, or, with ``init_fingerprint`` (the run's
    result's), if the file's header says it was trained from another init (a file copied in
    from another run); with ``result`` (the run's result.json), if the header names another
    run or the tensors are not the ones the run finished with (its ``weights_sha256``)."""
    tensors, metadata = load_weights(path)
    result = result or {}
    init = init_fingerprint or result.get("init_fingerprint")
    _check_header(path, metadata or {}, {**result, "init_fingerprint": init})
    digest = result.get("weights_sha256")
    if digest and state_digest(tensors, by_name=True) != digest:
        raise ValueError(f"{path}: its tensors are not the ones the run finished with (result.json records their "
                         f"digest {digest[:12]}…): the file was changed or comes from another run; {_REWRITE}")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshapen = sorted(k for k in set(expected) & set(tensors) if tuple(expected[k].shape) != tuple(tensors[k].shape))
    if missing or unexpected or misshapen:
        parts = [f"{name}: {', '.join(keys[:4])}{' …' if len(keys) > 4 else ''}"
                 for name, keys in (("missing", missing), ("unexpected", unexpected), ("other shape", misshapen))
                 if keys]
        raise ValueError(f"{path}: holds weights of another architecture than {type(model).__name__} "
                         f"({'; '.join(parts)}); pass the run folder the weights came from")
    model.load_state_dict(tensors)


def _check_header(path: Path, metadata: dict, result: dict) -> None:
    """The weights at ``path`` (their header's ``metadata``) are the run's whose result.json is
    ``result``: trained from the init it records (the more telling cause first), with its run id
    (a run written before run ids has none, and is not checked so)."""
    ours, theirs = result.get("init_fingerprint"), metadata.get("init_fingerprint")
    if ours and theirs and theirs != ours:
        raise ValueError(f"{path}: these weights were trained from another init (fingerprint {theirs[:12]}…) than "
                         f"the run's result.json records ({ours[:12]}…): the file comes from another run; {_REWRITE}")
    ours, theirs = result.get("run_id"), metadata.get("run_id")
    if ours and theirs and ours != theirs:
        raise ValueError(f"{path}: these weights are run {theirs}'s, and the folder's result.json is run {ours}'s: "
                         f"the file comes from another run; {_REWRITE}")
