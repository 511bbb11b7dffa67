"""Quantized weights under tensor parallelism: each rank's shard holds -tp 1's own codes and scales
(int8 cut after quantizing, GGUF blocks cut before packing), a cut inside a GGUF block is refused,
and outputs equal -tp 1's up to the rounding of the packed kernels' bfloat16 partial sums."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_loaders import hf_to_gguf
from test_tensor_parallel import PROMPTS
from tiny_model import make_tiny_model

from pagedkv import LLM, SamplingParams
from pagedkv.config import ConfigError
from pagedkv.distributed.shard import shard_model
from pagedkv.model.loader import load_model
from pagedkv.model.quant_linear import linear

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# how far one token's logprob may move: each rank's row-parallel partial sum is rounded to
# bfloat16 by the packed kernel (-tp 1 rounds the whole sum once); measured <= 0.05 here
TOL = 0.1


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """quantization -> model: the tiny HF folder (4 heads, 2 KV heads) for int8, its Q4_1 GGUF
    (blocks with scales and zeros, as the default model's) for gguf."""
    q4 = hf_to_gguf(Path(tiny_model_dir), tmp_path_factory.mktemp("q4") / "tiny.Q4_1.gguf", QT.Q4_1)
    return {"int8": tiny_model_dir, "gguf": str(q4)}


def transposed(w, k: int) -> torch.Tensor:
    """w's values as the kernel uses them, [k, N]: exact (one non-zero product per output)."""
    return linear(torch.eye(k), w).float()


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_each_rank_holds_tp1s_codes_and_scales(models, quantization):
    full = load_model(models[quantization], torch.float32, quantization=quantization).model
    c = full.config
    d, inter = c.head_dim, c.intermediate_size
    q_size, kv_size = c.num_attention_heads * d, c.num_key_value_heads * d
    for rank in range(2):
        part = load_model(
            models[quantization], torch.float32, quantization=quantization, pack=False
        )
        shard_model(part.model, rank, 2, lambda t: None)
        q = torch.arange(rank * q_size // 2, (rank + 1) * q_size // 2)
        kv = torch.arange(rank * kv_size // 2, (rank + 1) * kv_size // 2)
        mlp = torch.arange(rank * inter // 2, (rank + 1) * inter // 2)
        cuts = {  # name -> (output rows, input columns) of -tp 1's weight this rank holds
            "qkv_proj": (torch.cat([q, q_size + kv, q_size + kv_size + kv]), None),
            "o_proj": (None, q),
            "gate_up_proj": (torch.cat([mlp, inter + mlp]), None),
            "down_proj": (None, mlp),
        }
        for mine, whole in zip(part.model.layers, full.layers):
            for name, (rows, cols) in cuts.items():
                w, ref = getattr(mine, name), getattr(whole, name)
                assert type(w) is type(ref) and not isinstance(w, torch.Tensor)
                want = transposed(ref, ref.shape[1])
                want = want[:, rows] if rows is not None else want[cols]
                assert torch.equal(transposed(w, w.shape[1]), want), name
        assert type(part.model.embed_tokens) is type(full.embed_tokens)


def test_a_row_split_inside_a_gguf_block_is_refused(tmp_path):
    # head_dim 8: o_proj's 32 input features split 16 per rank, half a Q4_0 block of 32
    folder = make_tiny_model(tmp_path / "m", hidden=32, heads=4, kv_heads=2, intermediate=64)
    q4 = hf_to_gguf(Path(folder), tmp_path / "m.Q4_0.gguf", QT.Q4_0)
    with pytest.raises(ConfigError, match=r"o_proj: its 32 input features in 16 per rank .* of 32"):
        LLM(str(q4), quantization="gguf", dtype="float32", tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()  # refused before any worker started


def scores(llm: LLM, seqs: list[list[int]]) -> list[list[tuple[float, float, int]]]:
    """Per sequence and position j >= 1: (logprob of token j, the top-2 margin, its rank)."""
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
    result = []
    for seq, out in zip(seqs, outs):
        rows = []
        for j in range(1, len(seq)):
            entry = out.prompt_logprobs[j]
            assert entry.token_id == seq[j]
            first, second = sorted(entry.top.values(), reverse=True)[:2]
            rows.append((entry.logprob, first - second, entry.rank))
        result.append(rows)
    return result


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_quantized_tp2_equals_tp1_to_rounding(models, quantization):
    def llm(**options) -> LLM:
        return LLM(
            models[quantization],
            quantization=quantization,
            dtype="float32",
            num_gpu_blocks_override=64,
            block_size=4,
            **options,
        )

    one = llm()
    outs = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    want = scores(one, seqs)
    two = llm(tensor_parallel_size=2)
    try:
        outs2 = two.generate(PROMPTS, GREEDY, use_tqdm=False)
        got = scores(two, seqs)
    finally:
        two.engine.close()
    # the same tokens score alike, and -tp 1's pick stays the pick unless it was a near tie
    for w_seq, g_seq in zip(want, got):
        for (lp1, margin1, rank1), (lp2, _, rank2) in zip(w_seq, g_seq):
            assert abs(lp1 - lp2) < TOL
            assert rank1 != 1 or rank2 == 1 or margin1 < 2 * TOL
    # generating: the same tokens, but for a branch taken at a near tie of -tp 1's
    for o1, o2, w_seq in zip(outs, outs2, want):
        t1, t2 = o1.outputs[0].token_ids, o2.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(t1, t2)) if a != b), None)
        assert first is None or w_seq[len(o1.prompt_token_ids) - 1 + first][1] < 2 * TOL
