"""A tiny random-weight Llama as a Hugging Face folder, for fast tests with no downloads.

The folder has everything a real one has: config.json, model.safetensors,
tokenizer.json (byte-level BPE trained here on a fixed text), and
tokenizer_config.json with a ChatML template like SmolLM2's.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# a reasoning model's: `enable_thinking: false` closes an empty section (Qwen3's), `open_thinking`
# opens one for the model to fill (DeepSeek-R1's newer templates)
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% elif open_thinking is defined and open_thinking %}{{ '<think>\n' }}{% endif %}",
)
# make_tiny_model's architectures beyond Llama (test_model_vs_hf and test_loaders run each), and
# its mixtures of experts among them
EXPERT_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "granitemoe", "olmoe")
FAMILIES = ("qwen2", "qwen3", "phi3", "smollm3", "granite", "gemma", "gemma2", "gemma3") + (
    EXPERT_FAMILIES
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TAGS = ["<think>", "</think>"]  # added tokens, not special: they stay in decoded text
TOOL_TAGS = ["[TOOL_CALLS]"]  # Mistral's: a special token, gone from text decoded skipping those
MISTRAL_THINK_TAGS = ["[THINK]", "[/THINK]"]  # Magistral's: special tokens too
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in blocks. "
    "Hello world! Serving a model means holding each request's cache while it grows a token at a time. "
    "Memory is cut into fixed-size blocks handed out on demand, mapped by a block table. "
    "Émigré café naïve — 東京 😀 numbers 0123456789 and symbols {}[]()<>+-*/=_.,;:!?'\"\n"
)


def _train_tokenizer(
    vocab_size: int, think_tags: bool = False, tool_tags: bool = False, mistral_think: bool = False
):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    special = TOOL_TAGS * tool_tags + MISTRAL_THINK_TAGS * mistral_think
    added = THINK_TAGS * think_tags + special

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    if think_tags:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TAGS])
    if special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def _gemma3(num_layers: int, eos: int) -> dict:
    """Gemma 3's text model, small: every second layer attends to all, the others within 8 keys
    and with RoPE of their own base; q . k scaled by another length than head_dim's."""
    return {
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "layer_types": [
            "full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)
        ],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "pad_token_id": eos,
    }


# Granite's four multipliers, far from 1
GRANITE_MULTIPLIERS = {
    "embedding_multiplier": 2.5,
    "residual_multiplier": 0.4,
    "attention_multiplier": 0.2,
    "logits_scaling": 3.0,
}


def _experts(arch: str, num_layers: int, hidden: int) -> dict:
    """A tiny mixture of experts, 2 experts a token: 8 of half the MLP's width (Mixtral's,
    GraniteMoE's and OLMoE's: 4 of its width); Qwen3's last layer a plain MLP, Qwen2's shared expert as wide
    as the MLP."""
    if arch in ("mixtral", "granitemoe", "olmoe"):
        return {"num_local_experts": 4, "num_experts_per_tok": 2}
    extra = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden}
    if arch == "qwen3_moe":
        return {**extra, "mlp_only_layers": [num_layers - 1], "norm_topk_prob": True}
    return {**extra, "shared_expert_intermediate_size": 2 * hidden}


def _gemma(eos: int) -> dict:
    """Gemma (1): head_dim wider than hidden / heads, and the first files' "gelu" (which
    transformers reads as the tanh GELU)."""
    return {"head_dim": 32, "hidden_act": "gelu", "pad_token_id": eos}


def _gemma2(eos: int) -> dict:
    """Gemma 2, small: the first layer within 8 keys, the second over all (its default
    alternation), q . k scaled by another length than head_dim's, and soft-capping tight enough
    to change scores and logits (Gemma 2's own 50 and 30 barely touch a tiny model's)."""
    return {
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 2.0,
        "pad_token_id": eos,
    }


def make_tiny_model(
    path: str | Path,
    *,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 512,
    max_len: int = 2048,
    seed: int = 0,
    tie: bool = False,
    think_tags: bool = False,
    tool_tags: bool = False,
    mistral_think: bool = False,
    arch: str = "llama",
) -> str:
    """Write the folder (once) and return its path. arch: "llama", "qwen2" (q/k/v biases),
    "qwen3" (q/k norms, head_dim wider than hidden / heads), "phi3" (q/k/v and gate/up fused in
    the checkpoint), "granite" (its multipliers), "smollm3" (layers without RoPE: every 4th when
    num_layers is a multiple of 4, as llama.cpp assumes, else every 2nd), "gemma", "gemma2" or
    "gemma3" (Gemma 3's text model; see _gemma, _gemma2 and
    _gemma3), or "gemma3_vision" (that text model inside Gemma 3's image-and-text model, with a
    small vision tower). think_tags: <think> and </think> as added tokens;
    tool_tags: Mistral's [TOOL_CALLS] as a special token; mistral_think: Magistral's [THINK] and
    [/THINK], special tokens too."""
    import torch
    import transformers

    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(vocab_size, think_tags, tool_tags, mistral_think)
    tok.save(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    config_class, model_class, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 2 * hidden // heads}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": eos}),
        "granite": ("GraniteConfig", "GraniteForCausalLM", GRANITE_MULTIPLIERS),
        # SmolLM3: every n-th layer without RoPE (NoPE), here every second
        "smollm3": (
            "SmolLM3Config",
            "SmolLM3ForCausalLM",
            {"no_rope_layer_interval": 4 if num_layers % 4 == 0 else 2, "pad_token_id": eos},
        ),
        # mixtures of experts: Qwen3's with its last layer dense (mlp_only_layers), Qwen2's with a
        # shared expert, Mixtral's (see _experts)
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _experts(arch, num_layers, hidden)),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", _experts(arch, num_layers, hidden)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", _experts(arch, num_layers, hidden)),
        # OLMoE: q and k norms over all heads at once, q, k and v clipped
        "olmoe": (
            "OlmoeConfig",
            "OlmoeForCausalLM",
            {"clip_qkv": 1.5, **_experts(arch, num_layers, hidden)},
        ),
        "granitemoe": (
            "GraniteMoeConfig",
            "GraniteMoeForCausalLM",
            {**GRANITE_MULTIPLIERS, **_experts(arch, num_layers, hidden)},
        ),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", _gemma(eos)),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", _gemma2(eos)),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3(num_layers, eos)),
        "gemma3_vision": (
            "Gemma3TextConfig",
            "Gemma3ForConditionalGeneration",
            _gemma3(num_layers, eos),
        ),
    }[arch]
    cfg = getattr(transformers, config_class)(
        **extra,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=eos,
    )
    if arch == "gemma3_vision":  # 28-pixel images of 2 x 2 patches, 4 tokens each
        vision = transformers.SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        ids = {"boi_token_index": 500, "eoi_token_index": 501, "image_token_index": 502}
        cfg = transformers.Gemma3Config(
            text_config=cfg, vision_config=vision, mm_tokens_per_image=4, eos_token_id=eos, **ids
        )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(cfg)
    with torch.no_grad():  # larger weights than the default init, so outputs depend on the input
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # (transformers 5 holds a layer's experts as one 3-d tensor)
                p.normal_(0.0, 0.15)
            elif name.endswith(".bias"):  # (zeros by default: a test could not tell them missing)
                p.normal_(0.0, 0.5)
            elif "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 1.5)
            elif arch.startswith("gemma") and "norm" in name:  # (stored as w - 1: zeros by default)
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": THINKING_TEMPLATE if think_tags else CHAT_TEMPLATE,
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "model_max_length": max_len,
            }
        )
    )
    return str(path)
