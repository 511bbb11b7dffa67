"""A random-weight Hugging Face folder in the shape of a published model, for benchmarks of shapes
no package ships (models are never fetched from a hub here).

    python benchmarks/random_model.py qwen2.5-0.5b /tmp/qwen25-05b [--dtype bfloat16] [--layers N]

The folder has config.json, model.safetensors, and a tokenizer.json whose vocabulary is the byte
alphabet plus filler tokens up to the model's vocabulary size (no merges), so that any engine can
load it and decode any token id. Speed depends on the shape alone; the text is meaningless.
`--layers N` keeps the first N layers (a mixture of experts too big for this machine's memory,
cut to what fits: each layer costs what it costs in the whole model).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers

# name -> (config class, config fields); the published models' config.json values
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen2.5-0.5b": (
        "Qwen2Config",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "gemma2-2b": (
        "Gemma2Config",
        dict(
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            max_position_embeddings=8192,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3-270m": (
        "Gemma3TextConfig",
        dict(
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            max_position_embeddings=32768,
            query_pre_attn_scalar=256,
            sliding_window=512,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-30b-a3b": (  # a mixture of 128 experts, 8 a token: 30.5B parameters, 3.3B active
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tokenizer(folder: Path, vocab_size: int) -> tuple[int, int]:
    """Byte-level BPE over the byte alphabet and filler tokens; returns (bos, eos) ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    filler = [f"<f{i}>" for i in range(vocab_size - len(alphabet) - len(specials))]
    vocab = {t: i for i, t in enumerate(alphabet + filler)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHAT_TEMPLATE,
                "bos_token": specials[0],
                "eos_token": specials[2],
                "add_bos_token": False,
            }
        )
    )
    return tok.token_to_id(specials[0]), tok.token_to_id(specials[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("folder", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="keep the first N layers only")
    a = ap.parse_args()
    a.folder.mkdir(parents=True, exist_ok=True)
    config_class, fields = SHAPES[a.shape]
    if a.layers:
        fields = {**fields, "num_hidden_layers": a.layers}
    bos, eos = write_tokenizer(a.folder, fields["vocab_size"])
    config = getattr(transformers, config_class)(**fields, bos_token_id=bos, eos_token_id=eos)
    torch.manual_seed(a.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, a.dtype))
    with torch.no_grad():  # the published models' scale of weights, so activations stay finite
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # (transformers 5 holds a layer's experts as one 3-d tensor)
                p.normal_(0.0, 0.02)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(a.folder), safe_serialization=True)
    print(f"{a.shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
