"""Loading never runs code a model brings along unless the user asks: pickled weights (`.bin`, `.pt`)
are refused without --allow-pickle-weights, and a model's own Python code (auto_map) without
--trust-remote-code. Each refusal is shown, and so is the flag that lifts it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from specdec.cli import main
from specdec.models.loading import ModelLoadError, load_model


@pytest.fixture(scope="module")
def pickled_model(tiny_llama, tmp_path_factory):
    """tiny_llama with its weights as a torch.save pickle (pytorch_model.bin) and no safetensors."""
    path = tmp_path_factory.mktemp("pickled")
    for f in tiny_llama.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, path / f.name)
    torch.save(load_file(tiny_llama / "model.safetensors"), path / "pytorch_model.bin")
    return path


def test_pickled_weights_are_refused_by_default(pickled_model, capsys):
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*--allow-pickle-weights"):
        load_model(str(pickled_model))
    assert main(["generate", "--target", str(pickled_model), "--draft", "none", "--max-tokens", "4", "w5"]) == 2
    err = capsys.readouterr().err
    assert "only pickle files (pytorch_model.bin)" in err and "--allow-pickle-weights" in err


def test_allow_pickle_weights_loads_them_with_the_same_output(pickled_model, tiny_llama, capsys):
    args = ["generate", "--draft", "none", "--max-tokens", "6", "--json", "w5 w6"]
    assert main(["--log-level", "ERROR", *args[:1], "--target", str(pickled_model), "--allow-pickle-weights",
                 *args[1:]]) == 0
    pickled = json.loads(capsys.readouterr().out)
    assert main([*args[:1], "--target", str(tiny_llama), *args[1:]]) == 0
    assert pickled["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]


@pytest.fixture
def remote_code_model(tiny_llama, tmp_path):
    """tiny_llama whose config points at Python files shipped beside it (auto_map); importing them
    leaves a marker file, so a test sees whether the code ran."""
    path = tmp_path / "remote-code"
    shutil.copytree(tiny_llama, path)
    marker = tmp_path / "the-model-code-ran"
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="specdec_custom", auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                         "AutoModelForCausalLM": "modeling_custom.CustomModel"})
    (path / "config.json").write_text(json.dumps(config))
    code = (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
            "from transformers import LlamaConfig\n\n\n"
            "class CustomConfig(LlamaConfig):\n    model_type = 'specdec_custom'\n")
    (path / "configuration_custom.py").write_text(code)
    (path / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\n\n\nclass CustomModel(LlamaForCausalLM):\n    pass\n")
    return path, marker


def test_model_code_does_not_run_without_trust_remote_code(remote_code_model, capsys):
    path, marker = remote_code_model
    with pytest.raises(ModelLoadError, match="ships its own Python code.*--trust-remote-code"):
        load_model(str(path))
    assert main(["generate", "--target", str(path), "--draft", "none", "--max-tokens", "4", "w5"]) == 2
    assert "--trust-remote-code" in capsys.readouterr().err
    assert not marker.exists()


def test_trust_remote_code_runs_it(remote_code_model):
    path, marker = remote_code_model
    try:
        load_model(str(path), trust_remote_code=True)
    except ModelLoadError:
        pass  # whether the custom class then loads is the model's business; its code ran
    assert marker.read_text() == "ran"
