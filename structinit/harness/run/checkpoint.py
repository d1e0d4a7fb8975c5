"""Run files: atomic checkpoints loaded without executing code, exported weights, metric
logs, and the checks that a checkpoint belongs to the run being resumed.

Every file is written by :func:`atomic_write_bytes`: to a temporary file in the same folder,
flushed and fsync'ed, renamed over the old one (``os.replace`` is atomic on POSIX), then the
folder fsync'ed, so a run killed at any instant leaves the old file or the new one, never a
torn one. A kill can leave the temporary (``.<name>.<8 characters>.tmp``) behind; the next run
in that folder removes it (:mod:`structinit.harness.run.folder`). A checkpoint is read back
with ``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers, so a
tampered file cannot run code. The final weights are also exported as safetensors
(``model.safetensors``, what timm and Hugging Face load: plain tensors and a string header).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import pickle
import re
import secrets
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from structinit.harness.errors import RunIOError, user_input
from structinit.utils.optional_imports import require

WEIGHTS = "model.safetensors"
EMA_WEIGHTS = "model_ema.safetensors"


# ``.<name>.<8 characters>.tmp``: what atomic_write_bytes writes, and all that stale-file
# cleanup may remove (8 characters: tempfile.mkstemp's names, which older versions wrote, too).
TEMPORARY = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp")


def _storage_failure(err: BaseException) -> str | None:
    """Why a write failed, when the storage refused it (full disk, no permission, read-only
    file system …), or None for any other error. torch.save reports a full disk as a
    RuntimeError of its zip writer ("unexpected pos …", "file write failed")."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    text = str(err)
    if isinstance(err, RuntimeError) and ("unexpected pos" in text or "file write failed" in text):
        return "the disk is full or the file could not be written"
    return None


def atomic_write_bytes(path: Path, write) -> None:
    """Call ``write(fileobj)`` on a temporary file and atomically move it to ``path``. If the
    storage refuses the write (a full disk, a folder that is not writable) this raises
    :class:`~structinit.harness.errors.RunIOError`, one line naming ``path``; the file that was
    there before is unchanged and the temporary file is removed."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Created 0666 less the umask (tempfile.mkstemp's are 0600), so the file renamed into place has the
        # permissions any other file the user writes has; O_EXCL: never reuse a stale one.
        name = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        tmp = name
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        why = _storage_failure(err)
        if why is None:
            raise
        kept = "the previous version is unchanged" if path.exists() else "nothing was written there"
        raise RunIOError(f"{path}: could not be written ({why}); {kept}") from err
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomically save ``state`` (tensors, state dicts, numbers, strings, lists, dicts)."""
    atomic_write_bytes(path, lambda f: torch.save(state, f))


def checkpoint_bytes(state: dict[str, Any]) -> bytes:
    """The bytes :func:`save_checkpoint` writes for ``state``, made now: a training step may
    change the tensors right after, while the bytes go to disk in the background."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


class BackgroundWrites:
    """Run-file writes in one background thread, one at a time and in order, so that the
    device trains on while a checkpoint is flushed and fsync'ed.

    :meth:`submit` waits for the write before it (a run keeps at most one in flight) and
    raises its error, if it failed; :meth:`wait` waits for the last one. An error is raised
    once, in the training thread, as the write itself raised it.
    """

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write) -> None:
        """Run ``write()`` in the background once the write before it has finished."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name="structinit-writes")
        self._thread.start()

    def _run(self, write) -> None:
        try:
            write()
        except BaseException as err:  # raised in the training thread, at the next submit or wait
            self._error = err

    def wait(self, raise_error: bool = True) -> None:
        """Wait for the write in flight; raise its error (unless ``raise_error`` is false: the
        caller is already handling another)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` without executing code."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    with warnings.catch_warnings(record=True) as caught:  # torch warns about odd pickles: reported below
        warnings.simplefilter("always")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated, corrupted, tampered with, or not a checkpoint at all
            raise ValueError(f"{path}: not a readable structinit checkpoint {_why_unreadable(err)}; delete it, "
                             "or start the run in another out_dir (--out)") from err
    for w in caught:  # a good file: its warnings are worth seeing
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return state


def _why_unreadable(err: Exception) -> str:
    """Why torch.load refused a file, in words that never relay torch's advice to retry with
    ``weights_only=False``: that would run whatever code the file carries."""
    text = str(err)
    code = re.search(r"GLOBAL ([\w.]+)", text)
    if code:
        return (f"(it refers to {code[1]}, which is code, not tensors or plain values); it cannot be loaded "
                "safely, and nothing in it was run")
    if isinstance(err, pickle.UnpicklingError) or "weights_only" in text:
        return ("(it holds something other than tensors and plain values); it cannot be loaded safely, and "
                "nothing in it was run")
    first = text.strip().splitlines()[0].split(". ")[0] if text.strip() else ""
    return f"({type(err).__name__}: {first}): it is truncated, corrupted or another kind of file"


def save_weights(path: Path, state_dict: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Atomically write ``state_dict`` as a safetensors file, keys unchanged, tensors on the
    CPU and contiguous; ``metadata`` (str → str) goes into its header, with ``format: pt``
    (what Hugging Face's loaders check) unless given. The same tensors and metadata give the same
    bytes in every process (the header's keys sorted)."""
    st = require("safetensors.torch", "exporting weights")
    meta = {"format": "pt", **(metadata or {})}
    bad = [k for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"save_weights: metadata[{bad[0]!r}] is not a string; safetensors headers hold str → str "
                        "(JSON-encode other values)")
    tensors, storages = {}, set()
    for name, value in state_dict.items():
        t = value.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr in storages:
            t = t.clone()  # tied weights: safetensors refuses tensors that share memory
        storages.add(ptr)
        tensors[name] = t
    data = _canonical_header(st.save(tensors, metadata=meta))
    atomic_write_bytes(path, lambda f: f.write(data))


def _canonical_header(data: bytes) -> bytes:
    """The safetensors file ``data`` with its JSON header's keys sorted: safetensors writes the
    metadata in the order of a hash map seeded per process, so the same weights would make other
    bytes in each run. The header stays padded with spaces to a multiple of 8 bytes, as the format
    asks; the tensors' offsets are relative to the data after it, so they do not move."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + size :]


def load_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, metadata) of a file written by :func:`save_weights`, tensors on the CPU."""
    return _read_weights(Path(path), tensors=True)


def weights_metadata(path: Path) -> dict[str, str]:
    """The metadata in the header of a file written by :func:`save_weights` (its run id, init
    fingerprint, config), read without its tensors; the errors of :func:`load_weights`."""
    return _read_weights(Path(path), tensors=False)[1]


def _read_weights(path: Path, tensors: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights file not found; expected a safetensors file like a run's {WEIGHTS}")
    safetensors = require("safetensors", "loading weights")
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            state = {name: f.get_tensor(name) for name in f.keys()} if tensors else {}
    except Exception as err:  # truncated, corrupted or not safetensors at all
        raise ValueError(
            f"{path}: not a readable safetensors file (expected an 8-byte header length, a JSON header and the "
            f"tensor bytes, as save_weights writes): {type(err).__name__}: {' '.join(str(err).split())}; if it is a "
            f"run's export, `structinit train --resume --out {path.parent}` writes it again from the run's checkpoint"
        ) from err
    return state, metadata


def init_fingerprint(model: nn.Module) -> str:
    """SHA-256 of the model's initial state dict (names, dtypes, shapes and bytes, in order).

    A checkpoint records it, so resuming (or re-reading a finished run in ``compare``) under
    an init whose code or defaults have since changed is refused instead of silently mixing
    runs that did not start from the same weights.
    """
    return state_digest(model.state_dict())


def run_id(config: dict, fingerprint: str, data: dict, free: tuple[str, ...] = ()) -> str:
    """A run's identity: the SHA-256 (first 16 hex digits) of its resolved config (its seed
    within; not its folder, a run moved being the same run, nor the ``free`` fields that change
    how it computes, not what), the fingerprint of the weights it started from, and which copy
    of the data it read. ``result.json`` and the exported weights record it; the readers check
    that they agree."""
    kept = {k: v for k, v in config.items() if k != "out_dir" and k not in free}
    made = {"config": kept, "init": fingerprint, "data": data}
    return hashlib.sha256(json.dumps(made, sort_keys=True, default=str).encode()).hexdigest()[:16]


def result_digest(result: dict) -> str:
    """SHA-256 of a result as its file holds it (JSON, keys sorted), less its own
    ``result_sha256``: what the run wrote, so that a reader tells a file edited since."""
    kept = {k: v for k, v in result.items() if k != "result_sha256"}
    return hashlib.sha256(json.dumps(json.loads(json.dumps(kept)), sort_keys=True).encode()).hexdigest()


def state_digest(state: dict[str, torch.Tensor], by_name: bool = False) -> str:
    """SHA-256 of a state dict's names, dtypes, shapes and bytes, in its order (``by_name``: in
    the order of the names, as a safetensors file, which sorts them, gives them back)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()) if by_name else state.items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


RUN_STATE_KEYS = ("config", "epoch", "model", "optimizer", "scaler", "history", "wall_s")


def resume_state(path: Path, resume: bool, config: dict[str, Any], keys: tuple[str, ...] = RUN_STATE_KEYS,
                 defaults: dict[str, Any] | None = None, as_ran=None) -> dict[str, Any] | None:
    """The checkpoint at ``path`` to continue from, or None if there is none yet. A run that
    exists is refused (as an input error) unless ``resume``, if the file is not a run checkpoint
    with ``keys`` (another torch.save'd dict, say: refused before its missing entries surface
    as a KeyError halfway through resuming), or if it was written under another ``config``
    (:func:`check_same_config`, with ``defaults`` for fields added since and ``as_ran``)."""
    if not path.exists():
        return None
    with user_input("resume"):
        if not resume:
            raise FileExistsError(f"{path} exists: pass resume=True (--resume) or choose another out_dir")
        state = load_checkpoint(path)
        missing = [k for k in keys if k not in state] if isinstance(state, dict) else list(keys)
        if missing:
            found = ", ".join(map(str, state)) if isinstance(state, dict) else f"a {type(state).__name__}"
            raise ValueError(f"{path}: not the checkpoint of a structinit run (no {', '.join(missing)}; found "
                             f"{found or 'nothing'}); delete it, or start the run in another out_dir (--out)")
        check_same_config(state["config"], config, path, defaults, as_ran)
    return state


def check_same_config(saved: dict[str, Any], config: dict[str, Any], path: Path,
                      defaults: dict[str, Any] | None = None, as_ran=None) -> None:
    """Refuse to resume ``path`` (whose checkpoint holds ``saved``) under a different ``config``
    (both ``ImageConfig.to_dict()``; ``out_dir`` may differ). ``defaults``: the values of
    fields added since ``saved`` was written (a checkpoint without the field ran with that
    value, so it still resumes). ``as_ran`` maps a config to what it does here (``precision``
    ``'auto'`` to the precision it resolves to), so that a setting spelt another way but
    running the same resumes."""
    now = {k: v for k, v in config.items() if k != "out_dir"}
    old = {**(defaults or {}), **{k: v for k, v in saved.items() if k != "out_dir"}}
    if as_ran is not None:
        now, old = as_ran(now), as_ran(old)
    now["betas"], old["betas"] = list(now["betas"]), list(old.get("betas", []))  # a tuple comes back as a list
    diff = sorted(k for k in set(now) | set(old) if now.get(k) != old.get(k))
    if diff:
        raise ValueError(
            f"{path} was written with a different configuration ({', '.join(diff)} differ); "
            "resume with the same settings, or start a new run in another --out folder"
        )


def check_same_init(state: dict[str, Any], fingerprint: str, path: Path) -> None:
    """Refuse to resume ``path`` if it started from other initial weights than ``fingerprint``."""
    saved = state.get("init_fingerprint")
    if saved is not None and saved != fingerprint:
        raise ValueError(
            f"{path} was trained from different initial weights than this configuration gives now "
            f"(init fingerprint {saved[:12]}… vs {fingerprint[:12]}…): the init's code or defaults, or the "
            "torch version, changed since; start a new run in another --out folder"
        )


def write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, lambda f: f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()))


def write_png(path: Path, fig, **savefig: Any) -> Path:
    """A matplotlib figure written as a PNG at ``path`` atomically (:func:`atomic_write_bytes`),
    then closed; ``savefig`` options (e.g. ``bbox_inches='tight'``) are passed on."""
    plt = require("matplotlib.pyplot", "figures")
    atomic_write_bytes(Path(path), lambda f: fig.savefig(f, format="png", **savefig))
    plt.close(fig)
    return Path(path)


class MetricsLog:
    """Per-epoch metrics as JSON lines (``metrics.jsonl``) and a CSV (``metrics.csv``).

    Both files are rewritten from the in-memory history whenever a row is added, atomically,
    so they always agree with the last checkpoint after a resume (no duplicated epochs).
    """

    def __init__(self, folder: Path, history: list[dict] | None = None):
        self.folder = Path(folder)
        self.history: list[dict] = list(history or [])

    def append(self, row: dict) -> None:
        self.history.append(row)
        self.flush()

    def flush(self) -> None:
        lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.history)
        atomic_write_bytes(self.folder / "metrics.jsonl", lambda f: f.write(lines.encode()))
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=sorted({k for r in self.history for k in r}))
        writer.writeheader()
        writer.writerows(self.history)
        atomic_write_bytes(self.folder / "metrics.csv", lambda f: f.write(table.getvalue().encode()))
