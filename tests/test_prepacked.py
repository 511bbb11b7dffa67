"""bfloat16 weights prepacked for oneDNN: the same bits as F.linear, for a matmul alone and for a
whole model; a tied lm_head gets its own copy (counted, and planned); float32 stays plain.

Where this CPU's oneDNN cannot prepack bfloat16 (no AVX-512), the tests check that the weights
stay plain tensors and the model runs as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_model_vs_hf import PagedDriver, Seq
from tiny_model import make_tiny_model

from pagedkv.model import prepacked
from pagedkv.model.loader import load_model
from pagedkv.model.prepacked import PrepackedWeight, prepack
from pagedkv.sim.shapes import resolve_shape

PROMPT = "Paged attention keeps the KV cache in blocks. Hello world!"


@pytest.fixture
def prepacking(monkeypatch):
    """Sets $PAGEDKV_PREPACK for the loads inside the test (supported() is cached per process)."""

    def use(on: bool) -> bool:
        monkeypatch.setenv(prepacked.ENV, "1" if on else "0")
        prepacked.supported.cache_clear()
        return prepacked.supported()

    yield use
    monkeypatch.delenv(prepacked.ENV, raising=False)
    prepacked.supported.cache_clear()


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tied"), tie=True)


@pytest.mark.parametrize("shape", [(64, 96), (960, 576), (100, 36)])
def test_a_prepacked_matmul_is_f_linear_bit_for_bit(shape, prepacking):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen).to(torch.bfloat16)
    if not prepacking(True):
        assert prepack(w) is w
        return
    packed = prepack(w)
    assert isinstance(packed, PrepackedWeight) and packed.shape == shape
    for rows in (1, 3, 17, 64):
        x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
        assert torch.equal(packed.mm(x), F.linear(x, w)), rows
        assert torch.equal(packed.mm(x.view(1, rows, -1)), F.linear(x, w).view(1, rows, -1))
    w32 = w.float()
    assert prepack(w32) is w32  # float32 keeps F.linear's (MKL's) exact results
    prepacking(False)
    assert prepack(w) is w


def test_a_bf16_model_prepacked_gives_the_same_logits(tied_model, prepacking):
    on = prepacking(True)
    fast = load_model(tied_model, torch.bfloat16, quantization="none")
    prepacking(False)
    plain = load_model(tied_model, torch.bfloat16, quantization="none")
    layer = fast.model.layers[0]
    kinds = {type(w) for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)}
    assert kinds == ({PrepackedWeight} if on else {torch.nn.Parameter})
    assert isinstance(plain.model.layers[0].qkv_proj, torch.nn.Parameter)
    assert plain.model.lm_head is plain.model.embed_tokens
    assert isinstance(fast.model.embed_tokens, torch.Tensor)  # lookups need the plain rows
    assert isinstance(fast.model.lm_head, PrepackedWeight if on else torch.Tensor)
    vocab, hidden = fast.config.vocab_size, fast.config.hidden_size
    extra = vocab * hidden * 2 if on else 0  # the tied lm_head's own copy
    assert fast.model.weight_bytes() == plain.model.weight_bytes() + extra
    ids = fast.tokenizer.encode(PROMPT)
    drivers = [PagedDriver(m, 16) for m in (fast, plain)]
    seqs = [Seq(list(ids)) for _ in drivers]
    for _ in range(4):
        a, b = (d.step([(s, len(s.tokens) - s.computed)]) for d, s in zip(drivers, seqs))
        assert torch.equal(a, b)
        for s in seqs:
            s.tokens.append(int(b[0].argmax()))


def test_float32_weights_stay_plain(tied_model, prepacking):
    prepacking(True)
    lm = load_model(tied_model, torch.float32, quantization="none")
    assert isinstance(lm.model.layers[0].qkv_proj, torch.Tensor)
    assert lm.model.lm_head is lm.model.embed_tokens


def test_plan_counts_the_tied_head_copy(tied_model, tmp_path, prepacking):
    from test_loaders import hf_to_gguf

    on = prepacking(True)
    gguf = hf_to_gguf(Path(tied_model), tmp_path / "tied.gguf")
    lm = load_model(str(gguf), torch.bfloat16, quantization="none")
    assert (lm.model.lm_head is lm.model.embed_tokens) is not on
    assert resolve_shape(str(gguf), quantization="none").weight_bytes == lm.model.weight_bytes()
