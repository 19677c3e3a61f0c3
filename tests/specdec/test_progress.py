"""Forward progress (`specdec/engine/progress.py`): every decoder layer of a forward is counted, also on
a target whose linears are prepacked; models without decoder layers count their linears; the test
hooks come from the environment."""

import torch

from specdec.kernels.linear import PackedLinear
from specdec.models.loading import load_model
from specdec.engine.progress import ForwardProgress, progress_modules


def test_counts_every_decoder_layer_of_a_forward(tiny_llama):
    model = load_model(str(tiny_llama), torch.device("cpu"), "float32").model
    progress = ForwardProgress()
    assert progress.watch(model) == model.config.num_hidden_layers == 2
    assert progress.watch(model) == 0  # watching twice counts once
    with progress.running("forward"), torch.inference_mode():
        assert progress.snapshot()["call"] == "forward"
        model(input_ids=torch.tensor([[5, 6, 7]]))
    snapshot = progress.snapshot()
    assert (snapshot["num_layers"], snapshot["num_calls"], snapshot["call"]) == (2, 1, None)


def test_models_without_decoder_layers_count_their_linears_packed_or_not():
    model = torch.nn.Sequential(PackedLinear(torch.nn.Linear(8, 16)), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    assert progress_modules(model) == [model[0], model[2]]
    progress = ForwardProgress()
    progress.watch(model)
    with torch.inference_mode():
        model(torch.randn(3, 8))
    assert progress.num_layers == 2


def test_test_hooks_come_from_the_environment(monkeypatch):
    assert (ForwardProgress.from_env().layer_delay_s, ForwardProgress.from_env().wedge_forward) == (0.0, 0)
    monkeypatch.setenv("SPECDEC_TEST_LAYER_DELAY_S", "0.25")
    monkeypatch.setenv("SPECDEC_TEST_WEDGE_FORWARD", "2")
    progress = ForwardProgress.from_env()
    assert (progress.layer_delay_s, progress.wedge_forward) == (0.25, 2)
