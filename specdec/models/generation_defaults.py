"""The model's own sampling defaults: what its authors put in `generation_config.json`.

A request that omits a sampling field gets the model's value for it (vLLM's `--generation-config
auto`): Qwen2.5's instruct checkpoints, for example, sample at temperature 0.7, top_p 0.8, top_k 20
with a repetition penalty. `--generation-config` chooses where defaults come from:
- `auto` (the default): the target's `generation_config.json`; for a preset, whose GGUF conversion
  keeps only token ids, the catalog's copy of its authors' file (`presets.Preset.generation_defaults`,
  with its source) fills what the converted file lacks;
- `vllm` or `none`: none; a request's omitted fields take OpenAI's defaults (temperature 1, top_p 1,
  no penalties), as vLLM's `--generation-config vllm`;
- a directory: the `generation_config.json` in it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from specdec.models.presets import get_preset, is_preset

logger = logging.getLogger(__name__)

#: `generation_config.json` field -> the request field it gives a default to (vLLM takes the same).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}

MODES = ("auto", "vllm", "none")


def sampling_defaults(mode: str, target: str) -> dict:
    """{"values": {request field: value}, "source": where they come from} for a target spec."""
    if mode in ("vllm", "none"):
        return {"values": {}, "source": f"--generation-config {mode}: OpenAI's defaults"}
    if mode != "auto":
        directory = Path(mode).expanduser()
        if not (directory / "generation_config.json").is_file():
            raise ValueError(f"--generation-config: {mode!r} is not auto, vllm, none or a directory holding "
                             "generation_config.json")
        return {"values": _read(directory), "source": str(directory / "generation_config.json")}
    values, sources = {}, []
    if is_preset(target):
        preset = get_preset(target)
        values.update(preset.generation_defaults)
        if preset.generation_defaults:
            sources.append(preset.generation_defaults_source)
        from specdec.models import model_cache

        directory = model_cache.model_dir(target)
    else:
        from specdec.models.loading import resolve_spec

        resolved = resolve_spec(target)
        directory = Path(resolved.path) if resolved.kind in ("dir", "gguf") else None
    if directory is not None and (directory / "generation_config.json").is_file():
        found = _read(directory)
        if found:
            values.update(found)
            sources.append(str(directory / "generation_config.json"))
    return {"values": values, "source": " + ".join(sources) or "the model sets none: OpenAI's defaults"}


def _read(directory: Path) -> dict:
    """The sampling fields a generation_config.json sets (those that differ from HF's defaults)."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(directory).to_diff_dict()
    except Exception as e:  # noqa: BLE001 - an unreadable file: no defaults, said in the log
        logger.warning("cannot read %s/generation_config.json (%s); using OpenAI's defaults", directory, e)
        return {}
    return {FIELDS[k]: v for k, v in config.items() if k in FIELDS and v is not None}
