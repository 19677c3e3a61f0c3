"""Prepared draft weights on disk: prepare once, load many.

Preparing a draft at its precision (`draft_precision.py`) is arithmetic over every weight: int8
weight-only rounds the 0.5B Qwen draft's ~360M linear weights per output channel, ~5 s on a 2-core
CPU at every start. The result is plain tensors (int8 weights, bfloat16 scales, embeddings and
norms), so it is written once as safetensors to `$SPECDEC_CACHE/prepared/<key>/` and later loads
map that file (no copy, no pickles) into a skeleton of the prepared model built on the meta device.

The key is what the result depends on: the draft's weight files (name, size, mtime), the precision,
the kept vocabulary (its ids' hash), the torch version and this format's version. The rounding is
plain tensor arithmetic, independent of CPU features, so the CPU is not part of the key. Kernel
layouts that exist only in memory (oneDNN's prepacked bfloat16 weights, fbgemm's packed int8) are
opaque to safetensors: the bfloat16 draft caches its bfloat16 tensors and packs them at load.

Safety, as for the converted models (`model_cache.py`): an entry is built in a temporary directory
and renamed into place; its manifest holds the key, the file size and every tensor's dtype and
shape; on load the key and size must match, every tensor must match the skeleton's name, dtype and
shape, and nothing may stay on the meta device. An entry that fails any check is removed and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from specdec.models import model_cache

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"
#: CPU kernels assume aligned operands (`_weight_int8pack_mm` segfaults on an int8 weight that is
#: not 64-byte aligned, and safetensors aligns to 8). Every tensor is stored as raw bytes padded to a
#: multiple of ALIGN, after a header padded to one, so each starts aligned in the mapped file; one
#: that does not (a file written otherwise) is copied out of the map.
ALIGN = 64


def root() -> Path:
    return model_cache.prepared_root()


def vocab_digest(token_ids: torch.Tensor | None) -> str | None:
    if token_ids is None:
        return None
    return hashlib.sha256(token_ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def key_for(source: str, precision: str, vocab_token_ids: torch.Tensor | None) -> dict:
    return {"draft": model_cache.weights_id(source), "precision": precision, "vocab": vocab_digest(vocab_token_ids),
            "torch": torch.__version__.split("+")[0], "format": FORMAT_VERSION}


def entry_dir(key: dict) -> Path:
    return root() / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by state-dict name (tied ones under every name)."""
    return dict(module.state_dict(keep_vars=True))


def save(model: torch.nn.Module, key: dict) -> Path | None:
    """Write `model`'s tensors as the entry for `key`; returns its directory (None if it could not be written)."""
    state = {name: t.detach() for name, t in _tensors(model).items()}
    unique: dict[str, torch.Tensor] = {}  # name -> its bytes, padded to a multiple of ALIGN
    aliases: dict[str, str] = {}  # tied tensors are stored once
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ident in seen:
            aliases[name] = seen[ident]
        else:
            seen[ident] = name
            raw = t.contiguous().view(-1).view(torch.uint8)
            unique[name] = torch.nn.functional.pad(raw, (0, -raw.numel() % ALIGN))
    target = entry_dir(key)
    try:
        root().mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(dir=root(), prefix=".tmp-"))
        try:
            _save_aligned(unique, staged / WEIGHTS)
            manifest = {"key": key, "size": (staged / WEIGHTS).stat().st_size, "aliases": aliases,
                        "tensors": {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in state.items()}}
            (staged / MANIFEST).write_text(json.dumps(manifest, indent=1))
            staged.chmod(0o755)
            if target.exists():
                shutil.rmtree(target)
            os.replace(staged, target)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    except OSError as e:
        logger.warning("could not cache the prepared draft weights in %s: %s", target, e)
        return None
    logger.info("cached the prepared draft weights (%.2f GB) in %s", manifest["size"] / 1e9, target)
    return target


def _save_aligned(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`save_file`, with the header padded (through its metadata) so the data starts at a multiple of ALIGN."""
    from safetensors.torch import save_file

    pad = ""
    for _ in range(2):  # the header's length is a multiple of 8: one correction makes it a multiple of ALIGN
        save_file(tensors, str(path), metadata={"format": "pt", "pad": pad})
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        if (8 + header_len) % ALIGN == 0:
            return
        pad += " " * ((-(8 + header_len)) % ALIGN)


def load(skeleton: torch.nn.Module, key: dict) -> torch.nn.Module | None:
    """Fill `skeleton` (the prepared model's structure, tensors on the meta device) from the entry
    for `key`, memory-mapped; None when there is no valid entry (a damaged one is removed)."""
    from safetensors.torch import load_file

    directory = entry_dir(key)
    if not (directory / MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        if manifest.get("key") != json.loads(json.dumps(key)):
            raise ValueError("its key differs (a hash collision or a foreign file)")
        size = (directory / WEIGHTS).stat().st_size
        if size != manifest.get("size"):
            raise ValueError(f"{WEIGHTS} has {size} bytes, the manifest says {manifest.get('size')}")
        raw = load_file(directory / WEIGHTS)
        state = {}
        for name, (dtype, shape) in manifest["tensors"].items():
            if name in raw:
                want = getattr(torch, dtype)
                numel = math.prod(shape)
                tensor = raw[name][: numel * want.itemsize].view(want).view(shape)
                state[name] = tensor if tensor.data_ptr() % ALIGN == 0 else tensor.clone()
        for alias, name in manifest.get("aliases", {}).items():
            state[alias] = state[name]
        expected = _tensors(skeleton)
        if set(state) != set(expected) or set(manifest.get("tensors", {})) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise ValueError(f"its tensors do not match the model (missing {missing[:3]}, unexpected {extra[:3]})")
        for name, want in expected.items():
            got = state[name]
            if got.dtype != want.dtype or got.shape != want.shape:
                raise ValueError(f"{name} is {got.dtype}{list(got.shape)}, "
                                 f"the model needs {want.dtype}{list(want.shape)}")
        skeleton.load_state_dict(state, strict=True, assign=True)
        left = [n for n, t in [*skeleton.named_parameters(), *skeleton.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"{len(left)} tensors were not filled (e.g. {left[0]})")
    except Exception as e:  # noqa: BLE001 - any damage means: rebuild it
        logger.warning("the cached prepared draft weights in %s are unusable (%s): preparing them again", directory, e)
        shutil.rmtree(directory, ignore_errors=True)
        return None
    logger.info("loaded the prepared draft weights from %s", directory)
    return skeleton
