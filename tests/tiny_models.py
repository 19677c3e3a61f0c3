"""Tiny randomly initialised causal LMs, built from configs and saved to disk, so tests exercise the
real loading path (`load_model` on a directory) without any download."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tokenizer(vocab_size: int, eos: bool = True):
    """A word-level tokenizer over the words w0 .. w{n}; id 0 is <eos> when `eos`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>"] + [f"w{i}" for i in range(1, vocab_size)] if eos else [f"w{i}" for i in range(vocab_size)]
    vocab = {w: i for i, w in enumerate(words)}
    unk = "<eos>" if eos else "w0"
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    kwargs = {"eos_token": "<eos>"} if eos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


#: A chat template over the tiny vocabulary: role markers are words of it (w90 system, w91 user,
#: w92 assistant), so templated prompts tokenize to known ids.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ {'system': 'w90', 'user': 'w91', 'assistant': 'w92'}[m['role']] }} "
    "{{ m['content'] }} w93 {% endfor %}{% if add_generation_prompt %}w92 {% endif %}"
)


def make_config(arch: str, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, context: int = 512, init_range: float = 0.2, eos_token_id: int | None = 0):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        initializer_range=init_range,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch in FAMILIES:
        return family_config(arch, common)
    raise ValueError(arch)


#: Sliding window of the tiny sliding-window families: prompts and generations cross it.
TINY_WINDOW = 8

#: Decoder families users deploy, as tiny configs: `model_type` and what makes each one itself
#: (sliding windows, local/global layers, soft-capping, sinks, experts). Keys are test ids.
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": TINY_WINDOW, "max_window_layers": 0,
                                "layer_types": ["sliding_attention", "sliding_attention"]}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "mistral": ("mistral", {"sliding_window": TINY_WINDOW, "head_dim": 16}),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2": ("gemma2", {"sliding_window": TINY_WINDOW, "head_dim": 16, "query_pre_attn_scalar": 16,
                          "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3_text": ("gemma3_text", {"sliding_window": TINY_WINDOW, "head_dim": 16, "query_pre_attn_scalar": 16,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "attn_logit_softcapping": 50.0}),
    "cohere2": ("cohere2", {"sliding_window": TINY_WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {}),
    "granite": ("granite", {}),
    "olmo2": ("olmo2", {}),
    "starcoder2": ("starcoder2", {"sliding_window": TINY_WINDOW}),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "decoder_sparse_step": 1}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "gpt_oss": ("gpt_oss", {"sliding_window": TINY_WINDOW, "head_dim": 16, "num_local_experts": 4,
                            "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"]}),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0]}),
}


def family_config(family: str, common: dict):
    from transformers import AutoConfig

    model_type, extra = FAMILIES[family]
    return AutoConfig.for_model(model_type, **{**common, **extra})


def make_model(path: Path, arch: str = "llama", vocab_size: int = 96, seed: int = 0, tokenizer=None,
               perturb_from: Path | None = None, noise: float = 0.0, chat_template: str | None = None,
               pattern: list[int] | None = None, train_steps: int = 0, **config_kwargs) -> Path:
    """Build, save and return the directory of a tiny random model.

    `perturb_from`: start from that model's weights plus Gaussian noise of std `noise`, which gives a
    draft that agrees with the target often but not always. `pattern`, `train_steps`: a few Adam steps
    toward repeating `pattern`, which makes the model prefer (not always pick) continuing it.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    if perturb_from is not None:
        model = AutoModelForCausalLM.from_pretrained(perturb_from, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise * p.std().clamp(min=1e-3))
    else:
        config = make_config(arch, vocab_size, **config_kwargs)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if pattern and train_steps:
        sequence = torch.tensor([list(pattern) * (24 // len(pattern))])
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        for _ in range(train_steps):
            loss = model(sequence, labels=sequence).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(path)
    tok = tokenizer or make_tokenizer(model.config.vocab_size, eos=model.config.eos_token_id is not None)
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(path)
    return path


def make_family_pair(root: Path, family: str) -> tuple[Path, Path]:
    """A tiny target of `family` (no EOS, so generations run their full length) and a draft: its
    weights plus noise, which agrees with it often but not always."""
    root = Path(root)
    target = make_model(root / f"{family}-target", family, vocab_size=96, seed=1, eos_token_id=None)
    draft = make_model(root / f"{family}-draft", perturb_from=target, noise=0.05, seed=2)
    return target, draft


def hf_greedy_references(model_dir: Path, prompts: list[list[int]], max_tokens) -> list[list[int]]:
    """HF `generate()` of each prompt alone, greedy: the reference every engine must equal."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p, n in zip(prompts, counts)]
