"""Our forward through the paged cache equals Hugging Face transformers' LlamaForCausalLM (and
Mistral's, Qwen2's, Qwen3's, Phi-3's and Gemma 3's).

Greedy generation runs prompts through a minimal paged driver (shuffled
physical blocks, one forward for all prompts' prefills, one per decode step)
and must match transformers token for token; a cached prefix must not change
a single token.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tiny_model import FAMILIES, make_tiny_model

from pagedkv.attention.paged import AttentionMetadata
from pagedkv.config import ConfigError, default_model_path
from pagedkv.kvstore.storage import KVStorage
from pagedkv.model.loader import LoadedModel, load_model
from pagedkv.model.prepacked import PrepackedWeight
from pagedkv.model.quant_linear import linear

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. Paged attention",
    "Émigré café 東京 😀 0123",
    "Memory is cut into fixed-size blocks handed out on demand, mapped by",
]


@dataclass
class Seq:
    tokens: list[int]
    computed: int = 0
    table: list[int] = field(default_factory=list)


class PagedDriver:
    """The smallest engine: allocates shuffled blocks, builds metadata, runs steps."""

    def __init__(
        self, lm: LoadedModel, block_size: int, num_blocks: int = 64, seed: int = 0
    ) -> None:
        c = lm.config
        self.lm, self.block_size = lm, block_size
        self.storage = KVStorage(
            c.num_hidden_layers,
            num_blocks,
            c.num_key_value_heads,
            block_size,
            c.head_dim,
            lm.model.dtype,
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    @torch.inference_mode()
    def step(self, work: list[tuple[Seq, int]]) -> torch.Tensor:
        """Compute the next n tokens of each seq; float32 logits [B, vocab] of each one's last token."""
        bs = self.block_size
        ids, positions, slots = [], [], []
        for seq, n in work:
            end = seq.computed + n
            while len(seq.table) * bs < end:
                seq.table.append(self.free.pop())
            ids += seq.tokens[seq.computed : end]
            positions += range(seq.computed, end)
            slots += [seq.table[p // bs] * bs + p % bs for p in range(seq.computed, end)]
            seq.computed = end
        qlens = [n for _, n in work]
        width = max(len(s.table) for s, _ in work)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor([0, *qlens], dtype=torch.int32).cumsum(0).int(),
            seq_lens=torch.tensor([s.computed for s, _ in work], dtype=torch.int32),
            block_tables=torch.tensor(
                [s.table + [0] * (width - len(s.table)) for s, _ in work], dtype=torch.int32
            ),
            query_lens=qlens,
            seq_lens_list=[s.computed for s, _ in work],
            block_size=bs,
            is_decode=all(n == 1 for n in qlens),
            window=self.lm.config.sliding_window or 0,
        )
        hidden = self.lm.model(
            torch.tensor(ids), torch.tensor(positions), self.storage.kv_caches, meta
        )
        last = torch.tensor(qlens).cumsum(0) - 1
        return self.lm.model.compute_logits(hidden[last])

    def greedy(
        self,
        seqs: list[Seq],
        max_new: int,
        first_chunk: int | None = None,
        eos: set[int] = frozenset(),
    ) -> list[list[int]]:
        """All prompts prefilled together (optionally in two chunks), then decoded together."""
        if first_chunk is not None:
            self.step([(s, min(first_chunk, len(s.tokens) - 1)) for s in seqs])
        logits = self.step([(s, len(s.tokens) - s.computed) for s in seqs])
        outs: list[list[int]] = [[] for _ in seqs]
        live = list(range(len(seqs)))
        while True:
            for i, row in zip(live, logits.argmax(-1).tolist()):
                outs[i].append(row)
                seqs[i].tokens.append(row)
            live = [i for i in live if len(outs[i]) < max_new and outs[i][-1] not in eos]
            if not live:
                return outs
            logits = self.step([(seqs[i], 1) for i in live])


def hf_greedy(hf, ids: list[int], max_new: int, eos: set[int] = frozenset()) -> list[int]:
    """Reference: transformers' forward with its own KV cache, one token at a time."""
    out: list[int] = []
    with torch.inference_mode():
        step = hf(torch.tensor([ids]), use_cache=True)
        while True:
            out.append(int(step.logits[0, -1].argmax()))
            if len(out) == max_new or out[-1] in eos:
                return out
            key = "cache" if "cache" in step else "past_key_values"  # renamed in transformers 5
            step = hf(torch.tensor([[out[-1]]]), use_cache=True, **{key: step[key]})


def load_hf(folder) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, torch.float32), load_hf(tiny_model_dir)


def test_prefill_logits_match_transformers(tiny, kernels):
    lm, hf = tiny
    ids = lm.tokenizer.encode(PROMPTS[1])
    driver = PagedDriver(lm, block_size=4)
    seq = Seq(list(ids))
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
        hidden = lm.model(
            torch.tensor(ids),
            torch.arange(len(ids)),
            driver.storage.kv_caches,
            _single_meta(driver, seq, len(ids)),
        )
        ours = lm.model.compute_logits(hidden)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def _single_meta(driver: PagedDriver, seq: Seq, n: int) -> AttentionMetadata:
    bs = driver.block_size
    seq.table = [driver.free.pop() for _ in range(-(-n // bs))]
    return AttentionMetadata(
        slot_mapping=torch.tensor([seq.table[p // bs] * bs + p % bs for p in range(n)]),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([seq.table], dtype=torch.int32),
        query_lens=[n],
        seq_lens_list=[n],
        block_size=bs,
        is_decode=False,
    )


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batched_greedy_matches_transformers(tiny, block_size, kernels):
    lm, hf = tiny
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    want = [hf_greedy(hf, p, 12) for p in prompts]
    got = PagedDriver(lm, block_size, num_blocks=256).greedy([Seq(list(p)) for p in prompts], 12)
    assert got == want
    assert len({tuple(w) for w in want}) > 1  # the model is not degenerate


def test_two_chunk_prefill_gives_the_same_tokens(tiny):
    lm, _ = tiny
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    whole = PagedDriver(lm, 4, 128).greedy([Seq(list(p)) for p in prompts], 10)
    chunked = PagedDriver(lm, 4, 128, seed=1).greedy(
        [Seq(list(p)) for p in prompts], 10, first_chunk=8
    )
    assert chunked == whole


def test_decodes_and_prefills_in_one_step_give_the_same_tokens(tiny):
    # Continuous batching: sequence 0 decodes while the others prefill in the same forward.
    lm, _ = tiny
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    want = PagedDriver(lm, 4, 128).greedy([Seq(list(p)) for p in prompts], 7)
    driver = PagedDriver(lm, 4, 128, seed=2)
    seqs = [Seq(list(p)) for p in prompts]
    outs: list[list[int]] = [[] for _ in seqs]
    work = [(seqs[0], len(prompts[0]))]
    for step in range(7):
        for i, token in zip(range(len(work)), driver.step(work).argmax(-1).tolist()):
            outs[i].append(token)
            seqs[i].tokens.append(token)
        work = (
            [(seqs[0], 1)] + [(s, len(s.tokens)) for s in seqs[1:]]
            if step == 0
            else [(s, 1) for s in seqs]
        )
    assert outs[0] == want[0] and outs[1:] == [w[:6] for w in want[1:]]


def test_shared_prefix_blocks_give_the_same_tokens(tiny):
    # B reuses A's first two blocks (as a prefix cache hit would) and computes only its own suffix.
    lm, _ = tiny
    bs = 4
    prefix = lm.tokenizer.encode(PROMPTS[3])[: 2 * bs]
    a_ids, b_ids = prefix + lm.tokenizer.encode(" blocks"), prefix + lm.tokenizer.encode(" a table")
    driver = PagedDriver(lm, bs, 64)
    a = Seq(list(a_ids))
    driver.step([(a, len(a_ids))])
    b = Seq(list(b_ids), computed=2 * bs, table=a.table[:2])
    shared = driver.greedy([b], 10)
    fresh = PagedDriver(lm, bs, 64, seed=3).greedy([Seq(list(b_ids))], 10)
    assert shared == fresh


def _variant(src, dst: Path, **changes) -> Path:
    """A copy of the tiny model with config.json changed (None deletes a key)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


@pytest.mark.parametrize(
    "tie,changes",
    [
        # the pre-transformers-5 style: rope_theta and rope_scaling at the top
        (
            False,
            {
                "rope_parameters": None,
                "rope_theta": 20000.0,
                "rope_scaling": {"type": "linear", "factor": 4.0},
            },
        ),
        (
            False,
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
        (True, {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    ],
    ids=["linear", "llama3", "tied"],
)
def test_rope_scaling_and_tied_embeddings_match(tiny_model_dir, tmp_path, tie, changes):
    src = make_tiny_model(tmp_path / "tied", tie=True) if tie else tiny_model_dir
    folder = _variant(src, tmp_path / "m", **changes)
    lm, hf = load_model(folder, torch.float32), load_hf(folder)
    head, embed = lm.model.lm_head, lm.model.embed_tokens
    if isinstance(head, PrepackedWeight):  # a tied head gets a prepacked copy of the embedding
        x = torch.randn(3, embed.shape[1])
        tied = torch.allclose(head.mm(x), x @ embed.T, rtol=1e-5, atol=1e-5)
    else:
        tied = head is embed
    assert tied == tie
    assert lm.config.rope_theta == hf.config.rope_parameters["rope_theta"]
    ours_type = (lm.config.rope_scaling or {"rope_type": "default"})["rope_type"]
    assert ours_type == hf.config.rope_parameters["rope_type"]
    ids = lm.tokenizer.encode(PROMPTS[1] + " " + PROMPTS[3])
    assert PagedDriver(lm, 16, 64).greedy([Seq(list(ids))], 8) == [hf_greedy(hf, ids, 8)]


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 1.5, "beta_fast": 16}])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_yarn_matches_and_stretches_the_context(arch, tmp_path, extra):
    """YaRN (Qwen2.5's and Qwen3's long-context setting): frequencies blended by how often they
    turn in the original context, cos and sin scaled by the attention factor; prompts longer than
    the original context, as transformers computes them. Served up to original x factor."""
    src = make_tiny_model(tmp_path / arch, arch=arch)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    folder = _variant(
        src,
        tmp_path / "yarn",
        rope_parameters={**yarn, "original_max_position_embeddings": 16, **extra},
    )
    lm, hf = load_model(folder, torch.float32), load_hf(folder)
    assert lm.config.rope_scaling["rope_type"] == hf.config.rope_parameters["rope_type"] == "yarn"
    ids = lm.tokenizer.encode(PROMPTS[1] + " " + PROMPTS[3])
    assert len(ids) > 16
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    ours = PagedDriver(lm, 16, 64).step([(Seq(list(ids)), len(ids))])[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert PagedDriver(lm, 16, 64).greedy([Seq(list(ids))], 8) == [hf_greedy(hf, ids, 8)]
    short = _variant(
        src,
        tmp_path / "short",
        max_position_embeddings=32,
        rope_parameters={**yarn, "original_max_position_embeddings": 32},
    )
    assert load_model(short, torch.float32).max_model_len == 128


def test_bfloat16_logits_stay_close_to_float32(tiny_model_dir, tiny):
    lm32, _ = tiny
    lm16 = load_model(tiny_model_dir, torch.bfloat16)
    assert lm16.model.embed_tokens.dtype == torch.bfloat16
    ids = lm32.tokenizer.encode(PROMPTS[1])
    l32 = PagedDriver(lm32, 16).step([(Seq(list(ids)), len(ids))])
    l16 = PagedDriver(lm16, 16).step([(Seq(list(ids)), len(ids))])
    assert l16.dtype == torch.float32
    assert (l16 - l32).abs().max() < 0.05 * l32.abs().max()


# ---- Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms), Phi-3 (fused checkpoint) -----------------


@pytest.fixture(
    scope="module",
    params=FAMILIES,
)
def family(request, tmp_path_factory):
    """Qwen2, Qwen3, (fused in its checkpoint, otherwise Llama's) Phi-3, SmolLM3 (layers without
    RoPE), Granite (multipliers of the embeddings, residual adds, attention scale and logits),
    Gemma (its norms, GELU,
    embedding scale), Gemma 2 (norms after attention and the MLP, window layers, soft-capped
    scores and logits), Gemma 3 (q/k norms, window layers with a RoPE of their own; see
    tiny_model._gemma*) and three mixtures of experts (tiny_model._experts)."""
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param)
    return load_model(folder, torch.float32), load_hf(folder), folder


def test_other_families_match_transformers(family, kernels):
    lm, hf, _ = family
    assert (lm.config.qkv_bias, lm.config.qk_norm, lm.config.final_softcap) == (
        hf.config.model_type in ("qwen2", "qwen2_moe"),
        hf.config.model_type in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe"),
        getattr(hf.config, "final_logit_softcapping", None),
    )
    nope = [i for i in range(hf.config.num_hidden_layers) if not lm.config.layer_rope(i)]
    assert nope == ([1] if hf.config.model_type == "smollm3" else [])
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompts[1]])).logits[0]
    ours = PagedDriver(lm, 4).step([(Seq(list(prompts[1])), len(prompts[1]))])
    torch.testing.assert_close(ours[0], ref[-1], atol=1e-4, rtol=1e-4)
    want = [hf_greedy(hf, p, 12) for p in prompts]
    assert PagedDriver(lm, 4, num_blocks=128).greedy([Seq(list(p)) for p in prompts], 12) == want
    assert len({tuple(w) for w in want}) > 1


def test_other_families_in_bfloat16_stay_close_to_float32(family):
    lm32, _, folder = family
    lm16 = load_model(folder, torch.bfloat16)
    ids = lm32.tokenizer.encode(PROMPTS[1])
    l32 = PagedDriver(lm32, 16).step([(Seq(list(ids)), len(ids))])
    l16 = PagedDriver(lm16, 16).step([(Seq(list(ids)), len(ids))])
    assert (l16 - l32).abs().max() < 0.05 * l32.abs().max()


def test_gemma_3_image_and_text_checkpoint_serves_its_text_model(tmp_path):
    """Gemma 3's 4B-27B come as image-and-text checkpoints: their text model is served (logits and
    greedy output equal transformers' multimodal model on text), read under the older
    (language_model.model.*) and newer (model.language_model.*) tensor names alike, the vision
    tower left unread."""
    from safetensors.torch import load_file, save_file

    folder = Path(make_tiny_model(tmp_path / "mm", arch="gemma3_vision"))
    lm, hf = load_model(folder, torch.float32), load_hf(folder)
    assert type(hf).__name__ == "Gemma3ForConditionalGeneration"
    assert lm.config.qk_norm and lm.config.local_rope_theta == 1e4
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompts[1]])).logits[0, -1]
    ours = PagedDriver(lm, 4).step([(Seq(list(prompts[1])), len(prompts[1]))])[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    want = [hf_greedy(hf, p, 10) for p in prompts]
    assert PagedDriver(lm, 4, num_blocks=128).greedy([Seq(list(p)) for p in prompts], 10) == want
    tensors = load_file(folder / "model.safetensors")
    assert any(k.startswith("vision_tower.") for k in tensors)
    renamed = {
        k.replace("language_model.model.", "model.language_model."): v for k, v in tensors.items()
    }
    assert renamed != tensors
    newer = Path(shutil.copytree(folder, tmp_path / "newer"))
    save_file(renamed, newer / "model.safetensors")
    for a, b in zip(
        lm.model.state_dict().values(), load_model(newer, torch.float32).model.state_dict().values()
    ):
        assert torch.equal(a, b)
    save_file(
        {**tensors, "audio_tower.x": torch.zeros(2)},
        newer / "model.safetensors",
    )
    with pytest.raises(
        ConfigError, match="unexpected weight 'audio_tower.x' in a multimodal checkpoint"
    ):
        load_model(newer, torch.float32)


def _longrope(pairs: int, original: int, **extra) -> dict:
    """LongRoPE's parameters (Phi-3.5, Phi-4-mini): a factor per rotated pair for each set, far
    enough apart that the two sets give other tokens."""
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.5 * i for i in range(pairs)],
        "long_factor": [3.0 + 4.0 * i for i in range(pairs)],
        "original_max_position_embeddings": original,
        **extra,
    }


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_and_partial_rotary_match_transformers(partial, decode_backend, tmp_path):
    """Phi-3.5's and Phi-4-mini's RoPE: LongRoPE's factors (cos and sin scaled by its attention
    factor) and, for Phi-4-mini, RoPE on the first 3/4 of each head only. The long set where the
    context served exceeds the original length (here 16 of 64), else the short one, fixed for
    the engine's life as vLLM and llama.cpp fix it; transformers picks by the sequence's length,
    so both agree on a prompt past 16 tokens served to 64, and on one within 16 served to 16."""
    src = make_tiny_model(tmp_path / "phi3", arch="phi3")  # head_dim 16
    pairs = int(16 * partial) // 2
    folder = _variant(
        src,
        tmp_path / "longrope",
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_parameters=_longrope(pairs, 16, partial_rotary_factor=partial),
    )
    hf = load_hf(folder)
    long_lm = load_model(folder, torch.float32)
    assert long_lm.max_model_len == 64 and long_lm.config.rope_scaling["long"]
    assert long_lm.config.rope_dim == 2 * pairs == hf.model.rotary_emb.inv_freq.numel() * 2
    assert long_lm.model.rotary.cos.shape == (64, 2 * pairs)
    ids = long_lm.tokenizer.encode(PROMPTS[1] + " " + PROMPTS[3])
    short = long_lm.tokenizer.encode(PROMPTS[0])
    assert len(ids) > 16 > len(short) + 8
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    ours = PagedDriver(long_lm, 4, 64).step([(Seq(list(ids)), len(ids))])[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    want = hf_greedy(hf, ids, 8)
    assert PagedDriver(long_lm, 4, 64).greedy([Seq(list(ids))], 8) == [want]
    assert PagedDriver(long_lm, 4, 64).greedy([Seq(list(ids))], 8, first_chunk=7) == [want]

    short_lm = load_model(folder, torch.float32, max_model_len=16)
    assert not short_lm.config.rope_scaling["long"]
    assert short_lm.fingerprint != long_lm.fingerprint  # (other K/V: a disk tier parts them)
    want = hf_greedy(hf, short, 8)
    assert PagedDriver(short_lm, 4, 64).greedy([Seq(list(short))], 8) == [want]
    # the sets differ where it shows: the long one gives the short prompt other logits
    with torch.inference_mode():
        ref = hf(torch.tensor([short])).logits[0, -1]
    for lm, same in ((short_lm, True), (long_lm, False)):
        got = PagedDriver(lm, 4, 64).step([(Seq(list(short)), len(short))])[0]
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4) == same


def test_an_engine_serves_longrope_with_the_set_for_its_context(tmp_path):
    """--max-model-len picks the set: within the original length the short one."""
    from pagedkv import LLM

    src = make_tiny_model(tmp_path / "phi3", arch="phi3")
    folder = _variant(
        src,
        tmp_path / "longrope",
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_parameters=_longrope(8, 16),
    )
    for max_len, long in ((16, False), (64, True), (None, True)):
        llm = LLM(str(folder), dtype="float32", max_model_len=max_len)
        assert llm.engine.loaded.config.rope_scaling["long"] is long
        assert llm.engine.loaded.model.rotary.cos.shape[0] == (max_len or 64)


def test_rope_tables_are_as_long_as_the_context_served(tiny_model_dir):
    """--max-model-len sizes the RoPE tables (a 131,072-position model served to 8,192 holds 16x
    less of them); outputs are those of the full tables, and a model loaded for a shorter
    context than an engine asks is refused rather than read past its tables."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine

    short = load_model(tiny_model_dir, torch.float32, max_model_len=40)
    full = load_model(tiny_model_dir, torch.float32)
    assert short.model.rotary.cos.shape[0] == 40 and full.model.rotary.cos.shape[0] == 2048
    assert torch.equal(short.model.rotary.sin, full.model.rotary.sin[:40])
    ids = short.tokenizer.encode(PROMPTS[1])
    assert PagedDriver(short, 4).greedy([Seq(list(ids))], 8) == PagedDriver(full, 4).greedy(
        [Seq(list(ids))], 8
    )
    greedy = SamplingParams(temperature=0, max_tokens=40 - len(ids))  # up to the last position
    outs = [
        LLM(tiny_model_dir, dtype="float32", max_model_len=n).generate(
            [{"prompt_token_ids": ids}], greedy, use_tqdm=False
        )
        for n in (40, 2048)
    ]
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
    config = EngineConfig.from_options(model=tiny_model_dir, dtype="float32", max_model_len=64)
    with pytest.raises(ConfigError, match="built for a context of 40, not --max-model-len 64"):
        LLMEngine(config, loaded=short)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"partial_rotary_factor": 0.2}, "RoPE over 3 of 16 dimensions a head: needs an even"),
        ({"short_factor": [1.0] * 7}, "longrope short_factor must be 8 positive numbers"),
        ({"long_factor": [1.0] * 7 + [-1.0]}, "longrope long_factor must be 8 positive numbers"),
        ({"original_max_position_embeddings": None}, "longrope needs original_max_position"),
        ({"partial_rotary_factor": "half"}, "partial_rotary_factor must be in"),
        ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be in \(0, 1\], got 1.5"),
    ],
)
def test_bad_longrope_or_partial_rotary_is_refused(changes, message, tmp_path):
    src = make_tiny_model(tmp_path / "phi3", arch="phi3")
    rope = {k: v for k, v in {**_longrope(8, 16), **changes}.items() if v is not None}
    folder = _variant(
        src, tmp_path / "bad", original_max_position_embeddings=None, rope_parameters=rope
    )
    with pytest.raises(ConfigError, match=message):
        load_model(folder, torch.float32)


MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
QWEN = {"sliding_window": 8, "use_sliding_window": True}


@pytest.mark.parametrize(
    ("arch", "changes", "windows"),
    [
        ("llama", {**MISTRAL, "sliding_window": 8}, [8, 8]),
        ("phi3", {"sliding_window": 8}, [8, 8]),
        ("qwen2", {**QWEN, "max_window_layers": 1, "layer_types": None}, [None, 8]),
        ("qwen3", {**QWEN, "layer_types": ["sliding_attention", "full_attention"]}, [8, None]),
        ("qwen2", {"sliding_window": 8}, [None, None]),  # Qwen's use_sliding_window: off by default
    ],
)
def test_a_sliding_window_matches_transformers(arch, changes, windows, decode_backend, tmp_path):
    """Past its window a query sees only the last `sliding_window` keys (Mistral and Phi-3 on
    every layer, Qwen only with use_sliding_window, from max_window_layers on or where
    layer_types says): a prompt's logits, the prompt in two chunks, and greedy decoding beside a
    prompt shorter than the window, as transformers computes them; served to the model's full
    length."""
    folder = _variant(make_tiny_model(tmp_path / arch, arch=arch), tmp_path / "w", **changes)
    lm, hf = load_model(folder, torch.float32), load_hf(folder)
    assert lm.max_model_len == 2048
    assert [lm.config.layer_window(i) for i in range(2)] == windows
    ids = lm.tokenizer.encode(PROMPTS[1] + " " + PROMPTS[3])
    short = lm.tokenizer.encode(PROMPTS[0])
    assert len(ids) > 3 * 8 > 8 > len(short)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    ours = PagedDriver(lm, 4, 64).step([(Seq(list(ids)), len(ids))])[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    want = [hf_greedy(hf, ids, 10), hf_greedy(hf, short, 10)]
    assert PagedDriver(lm, 4, 64).greedy([Seq(list(ids)), Seq(list(short))], 10) == want
    chunked = PagedDriver(lm, 4, 64).greedy([Seq(list(ids))], 10, first_chunk=20)
    assert chunked == want[:1]
    full = load_model(_variant(folder, tmp_path / "full", sliding_window=None), torch.float32)
    # (no key: transformers' MistralConfig says 4096, longer than the prompt)
    assert full.config.sliding_window == (4096 if arch == "llama" else None)
    everything = PagedDriver(full, 4, 64).step([(Seq(list(ids)), len(ids))])[0]
    assert torch.allclose(everything, ours, atol=1e-3) == (windows == [None, None])


def test_disable_sliding_window_attends_to_everything_up_to_the_window(tmp_path):
    """vLLM's --disable-sliding-window: no window, and the model served up to it at most."""
    from pagedkv import LLM

    src = make_tiny_model(tmp_path / "m")
    folder = _variant(src, tmp_path / "w", **MISTRAL, sliding_window=8)
    whole = load_model(folder, torch.float32, sliding_window=False)
    assert whole.max_model_len == 8 and whole.config.layer_window(0) is None
    # a persistent KV tier keeps the two apart: past the window their K/V differ
    assert whole.fingerprint != load_model(folder, torch.float32).fingerprint
    llm = LLM(str(folder), dtype="float32", disable_sliding_window=True)
    assert llm.engine.max_model_len == 8
    assert LLM(str(folder), dtype="float32").engine.max_model_len == 2048


# ---- the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) -----------------------------------------

CHATS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "List three prime numbers.",
    "Explain paged attention in one sentence.",
    "Hi! 😀 Wie geht's?",
]


@pytest.fixture(scope="module")
def smol():
    """Ours from the GGUF, and transformers built from the same GGUF by its own dequantizer and
    Q/K un-permutation (transformers' GGUF path needs accelerate, so we call its converter directly)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    ours = load_model(None, torch.float32)
    hf_cfg = {
        k: v for k, v in load_gguf_checkpoint(str(path))["config"].items() if not k.startswith("_")
    }
    with torch.device("meta"):  # no random init: every weight comes from the file
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg))
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    hf.load_state_dict(tensors, strict=False, assign=True)
    hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)  # its buffers were on meta
    return ours, hf.eval(), tensors


@pytest.mark.slow
def test_default_model_weights_equal_transformers_dequantization(smol):
    ours, _, tensors = smol
    assert ours.name == "SmolLM2-135M-Instruct.Q4_1" and ours.max_model_len == 8192
    layer = ours.model.layers[7]
    qkv = linear(torch.eye(576), layer.qkv_proj).T  # (exact in any form: one product a sum)
    q, k, v = qkv.split([576, 192, 192])
    torch.testing.assert_close(q, tensors["model.layers.7.self_attn.q_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(k, tensors["model.layers.7.self_attn.k_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(v, tensors["model.layers.7.self_attn.v_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(
        ours.model.embed_tokens, tensors["model.embed_tokens.weight"], atol=0, rtol=0
    )


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(smol):
    ours, hf, _ = smol
    tok = ours.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]
    want = [hf_greedy(hf, p, 32, tok.eos_token_ids) for p in prompts]
    got = PagedDriver(ours, 16, 128).greedy(
        [Seq(list(p)) for p in prompts], 32, eos=tok.eos_token_ids
    )
    assert got == want
    assert "Paris" in tok.decode(got[0])


@pytest.mark.slow
def test_default_tokenizer_matches_transformers(smol):
    path = default_model_path()
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = smol[0].tokenizer
    texts = [
        "Hello world!",
        "  leading spaces and\ttabs\n\nnew lines",
        "numbers 1234567 and 3.14159",
        "Émigré café naïve — 東京 😀👍🏽 ünïcödé",
        "<|im_start|>user\nhi<|im_end|>",
        "don't I'll we've",
        "def f(x):\n    return x**2  # code",
    ]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(
            ids, skip_special_tokens=False
        )
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.eos_token_ids == {ref.eos_token_id} and ours.bos_token_id == ref.bos_token_id
