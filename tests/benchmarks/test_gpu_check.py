"""`benchmarks/gpu_check.py` stays runnable without a GPU: its CPU fallback runs every check here
(a few families; all of them and the Qwen pair on a GPU)."""

from benchmarks import gpu_check


def test_gpu_check_runs_on_the_cpu_and_prints_one_table(capsys):
    assert gpu_check.main(["--device", "cpu", "--families", "llama,gemma2", "--no-qwen"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| check | device | result | figure |")
    for check in ("greedy = HF generate: llama", "greedy = HF generate: gemma2", "logit_bias", "attention = per-row, 32 rows",
                  "Gumbel noise"):
        assert check in out
    assert "FAIL" not in out and "0 fail" in out
