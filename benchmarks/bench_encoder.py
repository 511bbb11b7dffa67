"""Encoder embedding throughput: a random-weight BERT, ModernBERT or EmbeddingGemma in the shape of
a published sentence-transformers model (all-MiniLM-L6-v2, bge-base-en-v1.5, modernbert-embed-base:
22 layers, windows of 128 on two in three; embeddinggemma-300m: Gemma 3's 24 layers attending both
ways, windows of 256 either way on five in six, its two Dense modules), its WordPiece tokenizer
trained on Alice's
first chapter, embedding 512 passages of that chapter (20 to 120 words) with pagedkv's LLM.embed,
or vLLM CPU's (`--engine vllm`, run with the peer venv's python: its pooling runner).

    python benchmarks/bench_encoder.py --make /tmp/minilm --shape all-minilm-l6-v2
    python benchmarks/bench_encoder.py --model /tmp/minilm [--dtype float32] [--rounds 3]
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=1 \
        /tmp/peers/venvs/vllm/bin/python benchmarks/bench_encoder.py --engine vllm \
        --model /tmp/minilm

Prints each round's texts and tokens a second, and the first vector's first values (the engines'
vectors agree: both pool as the folder's modules.json says, MEAN and unit length).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

ALICE = Path(__file__).resolve().parents[1] / "pagedkv" / "data" / "alice_ch1.txt"
# name -> the published config.json's shape
SHAPES = {
    "all-minilm-l6-v2": dict(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
    ),
    "bge-base-en-v1.5": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
    ),
    "modernbert-embed-base": dict(
        hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152
    ),
    "embeddinggemma-300m": dict(
        hidden_size=768,
        num_hidden_layers=24,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=256,
        intermediate_size=1152,
        query_pre_attn_scalar=256,
        sliding_window=512,
        max_position_embeddings=2048,
        use_bidirectional_attention=True,
    ),
}


def make(folder: Path, shape: str) -> None:
    """The random model as a sentence-transformers folder (MEAN pooling, normalized)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer

    folder.mkdir(parents=True, exist_ok=True)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train([str(ALICE)], WordPieceTrainer(vocab_size=4000, special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.decoder = decoders.WordPiece()
    tok.save(str(folder / "tokenizer.json"))
    names = ("pad", "unk", "cls", "sep", "mask")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "BertTokenizerFast",
                "model_max_length": 512,
                "do_lower_case": True,
                **{f"{n}_token": t for n, t in zip(names, special)},
            }
        )
    )
    torch.manual_seed(0)
    if shape.startswith("modernbert"):
        ids = {f"{n}_token_id": i for n, i in (("pad", 0), ("cls", 2), ("sep", 3), ("bos", 2))}
        config = transformers.ModernBertConfig(
            vocab_size=50368, eos_token_id=3, **ids, **SHAPES[shape]
        )
        model = transformers.ModernBertModel(config)
    elif shape.startswith("embeddinggemma"):
        config = transformers.Gemma3TextConfig(vocab_size=262144, pad_token_id=0, **SHAPES[shape])
        model = transformers.Gemma3TextModel(config)
    else:
        config = transformers.BertConfig(vocab_size=30522, **SHAPES[shape])
        model = transformers.BertModel(config)
    model.save_pretrained(str(folder))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    if shape.startswith("embeddinggemma"):  # (its 768 -> 3072 -> 768 projections, no bias)
        from safetensors.torch import save_file

        for idx, (n_in, n_out) in enumerate(((768, 3072), (3072, 768)), start=2):
            path = folder / f"{idx}_Dense"
            path.mkdir(exist_ok=True)
            dense = {"in_features": n_in, "out_features": n_out, "bias": False}
            dense["activation_function"] = "torch.nn.modules.linear.Identity"
            (path / "config.json").write_text(json.dumps(dense))
            weight = torch.randn(n_out, n_in) / n_in**0.5
            save_file({"linear.weight": weight}, str(path / "model.safetensors"))
            kind = "sentence_transformers.models.Dense"
            modules.insert(idx, {"idx": idx, "name": str(idx), "path": path.name, "type": kind})
        modules[-1].update(idx=4, name="4", path="4_Normalize")
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {"word_embedding_dimension": config.hidden_size, "pooling_mode_mean_tokens": True}
        )
    )
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 256, "do_lower_case": False})
    )
    print(
        f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters in {folder}"
    )


def passages(n: int = 512) -> list[str]:
    words = ALICE.read_text().split()
    rng = random.Random(0)
    out = []
    for _ in range(n):
        k = rng.randint(20, 120)
        start = rng.randrange(len(words) - k)
        out.append(" ".join(words[start : start + k]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", default="pagedkv", choices=["pagedkv", "vllm"])
    p.add_argument("--model", type=Path)
    p.add_argument("--make", type=Path, help="write the random model to this folder and stop")
    p.add_argument("--shape", default="all-minilm-l6-v2", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.make:
        make(args.make, args.shape)
        return
    texts = passages()
    if args.engine == "vllm":
        from vllm import LLM

        llm = LLM(model=str(args.model), dtype=args.dtype, runner="pooling", seed=0)
    else:
        from pagedkv import LLM

        llm = LLM(str(args.model), dtype=args.dtype, seed=0)
    tokens = sum(len(o.prompt_token_ids) for o in llm.embed(texts[:64], use_tqdm=False))
    tokens = tokens * len(texts) // 64  # (about: the warm-up's share)
    for r in range(args.rounds):
        t = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        dt = time.perf_counter() - t
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        first = ", ".join(f"{v:.4f}" for v in outs[0].outputs.embedding[:3])
        print(
            f"{args.engine} {args.model.name} {args.dtype} round {r}: {len(texts)} texts, "
            f"{tokens} tokens, {dt:.2f} s, {len(texts) / dt:.1f} texts/s, {tokens / dt:.0f} tok/s "
            f"[{first}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
