"""bfloat16 weights prepacked, in both forms: our GEMM's panels of k pairs ("pairs", within a
bfloat16 rounding step of F.linear: other summation order) and oneDNN's layout (the same bits as
F.linear); for a matmul alone and for a whole model; a tied lm_head gets its own copy (counted,
and planned); float32 stays plain.

Where this CPU runs neither form (no AVX512_BF16 for pairs, no AVX-512 for oneDNN's), the tests
check that form() says so, that the weights stay plain tensors and the model runs as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_model_vs_hf import PagedDriver, Seq
from tiny_model import make_tiny_model

from pagedkv import native
from pagedkv.model import prepacked
from pagedkv.model.loader import load_model
from pagedkv.model.prepacked import PrepackedWeight, prepack
from pagedkv.model.quant_linear import Blocks, pack_int4
from pagedkv.sim.shapes import resolve_shape

PROMPT = "Paged attention keeps the KV cache in blocks. Hello world!"


@pytest.fixture
def prepacking(monkeypatch):
    """Sets $PAGEDKV_PREPACK for the loads inside the test (form() is cached per process) and
    returns whether weights are prepacked then."""

    def use(setting: str) -> bool:
        monkeypatch.setenv(prepacked.ENV, setting)
        prepacked.form.cache_clear()
        return prepacked.supported()

    yield use
    monkeypatch.delenv(prepacked.ENV, raising=False)
    prepacked.form.cache_clear()


def close_to_f_linear(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Within what bfloat16 rounding of the result and float32 sums in any order allow of the
    exact product (a result that cancels to near 0 keeps only the sums' absolute error)."""
    exact = x.double() @ w.double().T
    bound = exact.abs() * 2**-8 + (x.double().abs() @ w.double().abs().T) * 2**-22
    assert ((F.linear(x, w).double() - exact).abs() <= bound).all()  # (the bound holds for torch)
    return bool(((got.double() - exact).abs() <= bound).all())


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tied"), tie=True)


@pytest.mark.parametrize("kind", ["pairs", "onednn"])
@pytest.mark.parametrize("shape", [(64, 96), (960, 576), (100, 36), (72, 1536), (31, 2)])
def test_a_prepacked_matmul_is_f_linear(kind, shape, prepacking):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen).to(torch.bfloat16)
    if not prepacked._probe(kind):  # this CPU lacks it: the form is not chosen
        prepacking("" if kind == "pairs" else "onednn")
        assert prepacked.form() != kind
        return
    packed = PrepackedWeight.of(w, kind)
    assert packed.shape == shape
    if kind == "pairs":  # every value once, no padding: memory is what the plan counts
        assert packed.nbytes == w.numel() * 2
    threads = torch.get_num_threads()
    try:
        for rows, t in ((1, 1), (3, 2), (17, 3), (64, 2), (64, 16), (300, 2), (301, 3)):
            torch.set_num_threads(t)
            x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
            got = packed.mm(x)
            if kind == "onednn":
                assert torch.equal(got, F.linear(x, w)), rows
            else:
                assert close_to_f_linear(got, x, w), (rows, t)
            assert torch.equal(packed.mm(x.view(1, rows, -1)), got.view(1, rows, -1))
            assert torch.equal(packed.mm(x.t().contiguous().t()), got)  # (rows of any stride)
    finally:
        torch.set_num_threads(threads)
    w32 = w.float()
    assert prepack(w32) is w32  # float32 keeps F.linear's (MKL's) exact results
    prepacking("0")
    assert prepack(w) is w


def test_the_gemm_refuses_what_it_cannot_multiply():
    lib = native.library()
    if lib is None or not lib.bf16_gemm:
        assert prepacked._probe("pairs") is False
        return
    x, w, out = (torch.zeros(4, 6, dtype=torch.bfloat16) for _ in range(3))
    fields = dict(
        x=x.data_ptr(), x_stride=6, w=w.data_ptr(), out=out.data_ptr(), out_stride=4, rows=4, n=4
    )
    with pytest.raises(native.KernelError, match="even k"):
        lib.call("gemm_bf16", **fields, k=5, threads=1)
    with pytest.raises(native.KernelError, match="row strides"):
        lib.call("gemm_bf16", **{**fields, "x_stride": 4}, k=6, threads=1)
    if prepacked.form() == "pairs":  # an odd k stays plain
        odd = torch.zeros(4, 5, dtype=torch.bfloat16)
        assert prepack(odd) is odd


def test_a_setting_that_is_no_form_is_refused(prepacking):
    with pytest.raises(ValueError, match="PAGEDKV_PREPACK='fast': want 0, onednn, or unset"):
        prepacking("fast")


@pytest.mark.parametrize("setting", ["", "onednn"])
def test_a_bf16_model_prepacked_gives_the_same_logits(tied_model, prepacking, setting):
    """oneDNN's form: the same bits; pairs: within bfloat16 rounding, the same greedy tokens."""
    on = prepacking(setting)
    kind = prepacked.form()
    fast = load_model(tied_model, torch.bfloat16, quantization="none")
    prepacking("0")
    plain = load_model(tied_model, torch.bfloat16, quantization="none")
    layer = fast.model.layers[0]
    kinds = {type(w) for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)}
    assert kinds == ({PrepackedWeight} if on else {torch.nn.Parameter})
    assert {getattr(w, "kind", "plain") for w in (layer.qkv_proj, fast.model.lm_head)} == {kind}
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
        if kind == "pairs":
            assert (a - b).abs().max() <= 0.03 * b.abs().max(), (a - b).abs().max()
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        else:
            assert torch.equal(a, b)
        for s in seqs:
            s.tokens.append(int(b[0].argmax()))


def test_float32_weights_stay_plain(tied_model, prepacking):
    prepacking("")
    lm = load_model(tied_model, torch.float32, quantization="none")
    assert isinstance(lm.model.layers[0].qkv_proj, torch.Tensor)
    assert lm.model.lm_head is lm.model.embed_tokens


def test_plan_counts_the_tied_head_copy(tied_model, tmp_path, prepacking):
    from test_loaders import hf_to_gguf

    on = prepacking("")
    gguf = hf_to_gguf(Path(tied_model), tmp_path / "tied.gguf")
    lm = load_model(str(gguf), torch.bfloat16, quantization="none")
    assert (lm.model.lm_head is lm.model.embed_tokens) is not on
    assert resolve_shape(str(gguf), quantization="none").weight_bytes == lm.model.weight_bytes()


@pytest.mark.parametrize(
    "n,k,group", [(64, 64, 32), (128, 576, 32), (192, 1536, 64), (64, 256, 128)]
)
def test_int4_panels_hold_aten_layouts_weights_and_multiply_them(n, k, group, prepacking):
    """4-bit weights in our GEMM's panels (where it runs): the same values as aten's layout, whole,
    by rows (embedding lookups) and in parts; products within rounding of the float64 one."""
    gen = torch.Generator().manual_seed(n + k)
    scale, zero = torch.rand(2, n, k // group, generator=gen) * 0.01
    b = Blocks(
        torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
        scale,
        zero - 0.005,
        group,
        4,
    )
    prepacking("onednn")
    aten = pack_int4(b)
    if not prepacking("") or prepacked.form() != "pairs":
        assert not pack_int4(b).panels  # no AVX512_BF16 here: aten's layout
        return
    ours = pack_int4(b)
    assert ours.panels and not aten.panels and ours.packed_nbytes == aten.packed_nbytes
    w = aten.dequantize()
    assert torch.equal(ours.dequantize(), w)
    ids = torch.tensor([0, 5, 17, 31, 32, 47, n - 1])
    assert torch.equal(ours.rows(ids, torch.float32), w[ids])
    assert torch.equal(ours.part(32, 64).dequantize(), w[32:64])
    threads = torch.get_num_threads()
    try:
        for rows, t in ((1, 1), (5, 2), (6, 2), (7, 3), (13, 2), (64, 16)):
            torch.set_num_threads(t)
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            exact = x.double() @ w.double().T
            bound = exact.abs() * 2**-8 + (x.double().abs() @ w.double().abs().T) * 2**-20
            assert ((ours.packed_mm(x).double() - exact).abs() <= bound).all(), (rows, t)
    finally:
        torch.set_num_threads(threads)
    lib = native.library()
    with pytest.raises(native.KernelError, match="multiple of 32"):
        lib.call(
            "gemm_int4", x=0, x_stride=k, codes=0, scales=0, out=0, out_stride=48, rows=1, n=48,
            k=k, group=group, threads=1,
        )  # fmt: skip
