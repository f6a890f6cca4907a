"""The RMSNorm part of ``hybridgemm.patch`` (fusion/norm.py): which modules are recognised,
the stock formula off the fast path (CPU, gradients), the fast path's glue around the Triton
kernel (run here under the interpreter by letting CPU tensors take it), state-dict keys and
unpatch."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import hybridgemm
from hybridgemm import norm as hnorm
from hybridgemm.kernels.triton_launch import interpreting

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.mistral.modeling_mistral import MistralRMSNorm  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm  # noqa: E402

EPS = 1e-5


def stock_norm(cls=LlamaRMSNorm, h=96, dtype=torch.float32, seed=0):
    m = cls(h, eps=EPS).to(dtype)
    with torch.no_grad():
        m.weight.copy_(1 + 0.5 * torch.randn(h, generator=torch.Generator().manual_seed(seed)))
    return m


def patched_copy(stock):
    import copy

    m = copy.deepcopy(stock)
    hybridgemm.patch(nn.Sequential(m), strict=True)
    assert type(m) is hnorm.HybridRMSNorm
    return m


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm])
def test_transformers_rms_norms_are_recognised(cls):
    assert hnorm.is_rms_norm(cls(8))


_FAMILY_OF = {"Llama": "llama", "Qwen2": "qwen2", "Qwen3": "qwen3", "Mistral": "mistral", "Mixtral": "mixtral",
              "Phi3": "phi3", "Granite": "granite", "GraniteMoe": "granitemoe", "Qwen2Moe": "qwen2_moe",
              "Qwen3Moe": "qwen3_moe", "Olmoe": "olmoe"}


@pytest.mark.parametrize("name", hnorm.RMS_NORM_CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_recognised_class_computes_the_reference_formula(name, dtype):
    """Each class in RMS_NORM_CLASSES, as the installed transformers defines it, computes
    reference_rms_norm bit for bit (what the kernel path and the decode step compute from)."""
    import importlib

    family = _FAMILY_OF[name.removesuffix("RMSNorm")]
    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    stock = stock_norm(cls, dtype=dtype)
    assert hnorm.is_rms_norm(stock)
    x = (torch.randn(4, 7, 96, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(stock(x), hnorm.reference_rms_norm(x, stock.weight, stock.variance_epsilon))


def test_other_norms_are_left_alone():
    class LlamaRMSNorm(nn.Module):  # the right name, defined outside transformers: formula unknown
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))
            self.variance_epsilon = 1e-6

    assert not hnorm.is_rms_norm(LlamaRMSNorm())
    assert not hnorm.is_rms_norm(nn.LayerNorm(8))
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    assert not hnorm.is_rms_norm(gemma.GemmaRMSNorm(8))  # scales by 1 + weight (HybridGemmaRMSNorm's)
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    assert not hnorm.is_rms_norm(olmo2.Olmo2RMSNorm(8))  # multiplies by the weight before rounding
    odd = LlamaRMSNorm.__new__(LlamaRMSNorm)
    nn.Module.__init__(odd)
    odd.weight = nn.Parameter(torch.ones(2, 4))  # not a 1-D weight
    odd.variance_epsilon = 1e-6
    assert not hnorm.is_rms_norm(odd)


def _fake_transformers_norm(forward, name="FakeRMSNorm"):
    """An RMSNorm-shaped class (1-D weight, variance_epsilon) of a transformers module, with ``forward``."""

    def init(self, hidden):
        nn.Module.__init__(self)
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = 1e-6
        self.eps = 1e-6

    return type(name, (nn.Module,), {"__init__": init, "forward": forward,
                                     "__module__": "transformers.models.fake.modeling_fake"})


def _llama_formula(self, hidden_states):
    return hnorm.reference_rms_norm(hidden_states, self.weight, self.variance_epsilon)


@pytest.mark.parametrize("module,name", [("deepseek_v3", "DeepseekV3RMSNorm"), ("glm4_moe", "Glm4MoeRMSNorm"),
                                         ("ernie4_5_moe", "Ernie4_5_MoeRMSNorm")])
def test_classes_outside_the_list_that_compute_the_formula_are_recognised_by_running_them(module, name):
    import importlib

    try:
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {name}")
    assert name not in hnorm.RMS_NORM_CLASSES
    assert hnorm.computes_rms_norm(cls(96)) and hnorm.is_rms_norm(cls(96))
    with torch.device("meta"):
        assert hnorm.is_rms_norm(cls(96))  # the probe runs on a CPU copy of any device's module
    stock = stock_norm(cls, dtype=torch.bfloat16)
    x = (torch.randn(4, 96, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(stock(x), hnorm.reference_rms_norm(x, stock.weight, stock.variance_epsilon))


def test_forwards_of_other_formulas_or_arguments_are_not_recognised():
    assert hnorm.computes_rms_norm(_fake_transformers_norm(_llama_formula)(16))

    def other_eps(self, hidden_states):  # reads its epsilon from another attribute
        return hnorm.reference_rms_norm(hidden_states, self.weight, self.eps)

    def fp32_scale(self, hidden_states):  # scales in fp32, rounds once (GPT-OSS's, OLMo 2's)
        h = hidden_states.float()
        return (self.weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(
            hidden_states.dtype)

    def gated(self, hidden_states, gate=None):  # a second argument HybridRMSNorm has no place for
        return _llama_formula(self, hidden_states)

    def raises(self, hidden_states):
        raise RuntimeError("needs a GPU")

    def renamed(self, x):
        return _llama_formula(self, x)

    for forward in (other_eps, fp32_scale, gated, raises, renamed):
        assert not hnorm.computes_rms_norm(_fake_transformers_norm(forward)(16)), forward.__name__
    outside = _fake_transformers_norm(_llama_formula)
    outside.__module__ = "my_models"
    assert not hnorm.computes_rms_norm(outside(16))
    two = _fake_transformers_norm(_llama_formula)(16)
    two.bias = nn.Parameter(torch.zeros(16))  # a second parameter: not this module's formula
    assert not hnorm.computes_rms_norm(two)
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    assert not hnorm.is_rms_norm(t5.T5LayerNorm(16))  # casts the row to a 16-bit weight's dtype
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    assert not hnorm.is_rms_norm(gpt_oss.GptOssRMSNorm(16))


@pytest.mark.parametrize("module,name,patched_as", [
    ("gpt_oss", "GptOssRMSNorm", "HybridOlmo2RMSNorm"), ("olmo3", "Olmo3RMSNorm", "HybridOlmo2RMSNorm"),
    ("helium", "HeliumRMSNorm", "HybridOlmo2RMSNorm"), ("qwen3_next", "Qwen3NextRMSNorm", "HybridGemmaRMSNorm"),
    ("vaultgemma", "VaultGemmaRMSNorm", "HybridGemmaRMSNorm")])
def test_classes_that_compute_gemmas_or_olmo2s_formula_are_recognised_by_running_them(module, name, patched_as):
    """Norms of the fp32-factor formulas outside the lists (OLMo 2's weight, Gemma's 1 + weight,
    scaled in fp32 and rounded once): taken by running them, patched as that formula's class,
    the stock bits on the CPU path; Llama's probe leaves them alone."""
    import importlib

    try:
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {name}")
    gemma = patched_as == "HybridGemmaRMSNorm"
    assert name not in hnorm.GEMMA_NORM_CLASSES + hnorm.OLMO2_NORM_CLASSES
    assert not hnorm.is_rms_norm(cls(96))
    assert hnorm.is_gemma_norm(cls(96)) is gemma and hnorm.is_olmo2_norm(cls(96)) is not gemma
    stock = cls(96)
    with torch.no_grad():
        stock.weight.copy_(torch.randn(96, generator=torch.Generator().manual_seed(1)))
    stock = stock.to(torch.bfloat16)
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    assert type(patched).__name__ == patched_as
    x = (torch.randn(4, 96, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    with torch.no_grad():
        want = stock(x)
        assert torch.equal(patched(x), want)
        reference = hnorm.reference_gemma_rms_norm if gemma else \
            (lambda x, w, eps: hnorm.fp32_factor_rms_norm(x, w, eps, 0.0))
        assert torch.equal(reference(x, stock.weight, patched.norm_eps()), want)
    hybridgemm.unpatch(patched)
    assert type(patched) is cls


def test_forwards_close_to_the_fp32_factor_formulas_are_not_taken_for_them():
    def olmo2(self, hidden_states):
        h = hidden_states.float()
        return (self.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))).to(
            hidden_states.dtype)

    def rounded_first(self, hidden_states):  # rounds the normalised row before an fp32 weight multiplies it
        h = hidden_states.float()
        return self.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(
            hidden_states.dtype)

    def gemma_of_variance_epsilon(self, hidden_states):  # Gemma's factor, another epsilon attribute
        return hnorm.reference_gemma_rms_norm(hidden_states, self.weight, self.variance_epsilon)

    assert hnorm.computes_olmo2_norm(_fake_transformers_norm(olmo2)(16))
    for forward in (rounded_first, gemma_of_variance_epsilon, _llama_formula):
        norm = _fake_transformers_norm(forward)(16)
        assert not hnorm.computes_olmo2_norm(norm) and not hnorm.computes_gemma_norm(norm), forward.__name__


def test_a_model_of_norms_outside_the_list_is_patched_and_gives_stock_logits():
    from helpers import tiny_moe_lm

    stock = tiny_moe_lm("glm4_moe", 97, 64, 8, 3, head_dim=16)
    model = copy.deepcopy(stock)
    report = hybridgemm.patch(model)
    norms = [n for n, m in model.named_modules() if n.endswith("layernorm") or n == "model.norm"]
    assert len(norms) == 5 and all(type(model.get_submodule(n)) is hnorm.HybridRMSNorm for n in norms)
    assert not any("norm not patched" in why for _, why in report.skipped), report.skipped
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
    hybridgemm.unpatch(model)
    assert all(type(model.get_submodule(n)) is type(stock.get_submodule(n)) for n in norms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_path_is_the_stock_formula_bit_for_bit(dtype):
    stock = stock_norm(dtype=dtype)
    patched = patched_copy(stock)
    x = (torch.randn(3, 5, 96) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(patched(x), stock(x))


def test_gradients_match_stock():
    stock = stock_norm()
    patched = patched_copy(stock)
    x1 = torch.randn(4, 96, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    stock(x1).square().sum().backward()
    patched(x2).square().sum().backward()
    assert torch.equal(x1.grad, x2.grad) and torch.equal(stock.weight.grad, patched.weight.grad)


@pytest.fixture
def cpu_fast_path(monkeypatch):
    """CPU tensors take the kernel path (Triton's interpreter runs it)."""
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 to run the Triton kernel on the CPU")
    calls = []
    real = hnorm._fast_path  # False for every CPU tensor; _eligible is the rest of its rule

    def fast(x, w):
        ok = real(x, w) or (x.device.type == "cpu" and hnorm._eligible(x, w, on_current_device=True))
        calls.append(ok)
        return ok

    monkeypatch.setattr(hnorm, "_fast_path", fast)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 4096), (2, 17, 96), (333, 96), (96,)])
def test_fast_path_matches_the_stock_module(cpu_fast_path, dtype, shape):
    h = shape[-1]
    stock = stock_norm(h=h, dtype=dtype, seed=h)
    patched = patched_copy(stock)
    x = (torch.randn(*shape) * 0.004).to(dtype)  # mean square ~1.6e-5, beside EPS: where eps goes shows
    with torch.no_grad():
        out, ref = patched(x), stock(x)
    assert cpu_fast_path == [True]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    # the same formula; only the order of the sum of squares differs: within a couple of ulp
    ulp = torch.finfo(dtype).eps
    bound = 2 * ulp * ref.float().abs().max()
    assert (out.float() - ref.float()).abs().max() <= bound
    xf, w = x.float(), stock.weight.float()
    ms = xf.pow(2).mean(-1, keepdim=True)
    for wrong in (w * xf * torch.rsqrt(ms), xf * torch.rsqrt(ms + EPS)):  # eps not passed; weight left out
        assert (wrong - ref.float()).abs().max() > 10 * bound  # the bound can fail


@pytest.mark.parametrize("h,width,start", [(64, 200, 10), (16, 24, 0), (32, 40, 8)])
def test_fast_path_reads_a_row_strided_input(cpu_fast_path, h, width, start):
    """Rows ``width`` apart; and narrow rows as DeepSeek-V3's attention normalises them (16 of each
    24-column row of its compressed K/V, a split view)."""
    stock = stock_norm(h=h)
    patched = patched_copy(stock)
    wide = torch.randn(2, 24, width)
    x = wide[..., start:start + h]
    with torch.no_grad():
        torch.testing.assert_close(patched(x), stock(x), rtol=2e-6, atol=1e-6)
    assert cpu_fast_path == [True]


def test_patched_model_keeps_keys_and_unpatch_restores():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=97)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    keys = list(model.state_dict())
    report = hybridgemm.patch(model, attention=False, mlp=False, lm_head=False)
    assert len(report.patched) == 5  # two per layer and the final norm
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        out = model(ids).logits
    hybridgemm.unpatch(model)
    assert not any(isinstance(m, hnorm.HybridRMSNorm) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, out)


def _gate(x, w, **kw):
    return hnorm._eligible(x, w, on_current_device=kw.get("on_device", True))


def test_the_fast_path_rule(monkeypatch):
    """Each condition of the Triton launch's rule, on CPU tensors (the device check aside)."""
    w = nn.Parameter(torch.ones(96))
    x = torch.randn(2, 96)
    with torch.no_grad():
        assert _gate(x, w)
        assert not _gate(x, w, on_device=False)
        assert not _gate(x.double(), w) and not _gate(x, w.double().detach())
        assert not _gate(torch.randn(96, 2).t(), w)  # last dim not unit-stride
        assert _gate(torch.randn(2, 200)[:, :96], w)  # rows strided: fine
        assert not _gate(torch.randn(2, 64), w)  # the weight does not fit: the stock path raises
        assert not _gate(x, torch.ones(2, 96)) and not _gate(x, torch.ones(192)[::2])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not _gate(x, w)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not _gate(x, w)
        # while compiling, nothing Dynamo cannot trace is asked (the current-device query is
        # a builtin that returns an int: fullgraph=True fails on it)
        fake_cuda = SimpleNamespace(is_cuda=True)
        monkeypatch.setattr(hnorm, "_PLAIN", (SimpleNamespace, *hnorm._PLAIN))
        monkeypatch.setattr(hnorm, "_current_device", lambda: pytest.fail("device queried while compiling"))
        assert not hnorm._fast_path(fake_cuda, w)
        monkeypatch.undo()
        seen = []
        torch.vmap(lambda t: seen.append(_gate(t, w)) or t)(x)
        assert seen == [False]  # vmap's batched tensors have no data pointer to launch on
    assert not _gate(x, w)  # grad enabled and w requires grad
    assert not _gate(x.requires_grad_(), w.detach())
    with torch.inference_mode():
        assert _gate(torch.randn(2, 96), w)


def test_a_width_mismatch_raises_as_stock_does():
    stock = stock_norm(h=96)
    patched = patched_copy(stock)
    x = torch.randn(2, 64)
    with torch.no_grad(), pytest.raises(RuntimeError) as stock_err:
        stock(x)
    with torch.no_grad(), pytest.raises(RuntimeError) as ours:
        patched(x)
    assert str(ours.value) == str(stock_err.value)


def test_qwen3_per_head_norms_on_fused_qkv_slices(cpu_fast_path):
    """Qwen3 normalises q and k per head (q_norm/k_norm on (..., heads, head_dim) views of the
    fused Q/K/V GEMM's slices): the kernel path gives the stock logits."""
    pytest.importorskip("transformers.models.qwen3")
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=97)
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config).eval()
    for m in stock.modules():
        if hnorm.is_rms_norm(m):
            with torch.no_grad():
                m.weight.copy_(1 + 0.5 * torch.randn_like(m.weight))
    import copy

    patched = copy.deepcopy(stock)
    report = hybridgemm.patch(patched)
    assert type(patched.model.layers[0].self_attn.q_norm) is hnorm.HybridRMSNorm
    assert report.fused_qkv == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        out, ref = patched(ids).logits, stock(ids).logits
    assert cpu_fast_path and all(cpu_fast_path)
    assert len(cpu_fast_path) == 2 * 4 + 1  # per layer: input, q, k, post-attention; the final norm
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- Gemma's formula


def _patched_gemma(stock):
    import copy

    m = copy.deepcopy(stock)
    hybridgemm.patch(nn.Sequential(m), strict=True)
    return m


def _gemma_norm(dtype, seed: int = 2):
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    stock = gemma.GemmaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        stock.weight.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(seed))
    return stock.to(dtype)


def _fp32_factor_norm(family: str, dtype):
    """A stock norm of ``family`` ("gemma": its 1 + w; "olmo2": its w, both in fp32), its patched
    class, the fp32 factor the decode step should get, and its epsilon."""
    if family == "gemma":
        stock = _gemma_norm(dtype)
        return stock, hnorm.HybridGemmaRMSNorm, 1.0 + stock.weight.float(), stock.eps
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    stock = olmo2.Olmo2RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    stock = stock.to(dtype)
    return stock, hnorm.HybridOlmo2RMSNorm, stock.weight.float(), stock.variance_epsilon


@pytest.mark.parametrize("family", ["gemma", "olmo2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp32_factor_norms_are_patched_and_compute_their_formula(family, dtype):
    """GemmaRMSNorm (1 + w) and Olmo2RMSNorm (w), each scaling the fp32 normalised x in fp32 and
    rounding once (Llama's formula rounds first, and differs from both in bf16), become
    HybridGemmaRMSNorm / HybridOlmo2RMSNorm: the stock module's output bit for bit, and the fused
    prologue's formula (prologue_norm over the fp32 factor the decode step hands the kernels) is
    that output too."""
    stock, cls, factor, eps = _fp32_factor_norm(family, dtype)
    assert hnorm.is_gemma_norm(stock) == (family == "gemma") and hnorm.is_olmo2_norm(stock) == (family == "olmo2")
    assert not hnorm.is_rms_norm(stock)
    patched = _patched_gemma(stock)
    assert type(patched) is cls
    x = (torch.randn(4, 7, 96, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    with torch.no_grad():
        want = stock(x)
        assert torch.equal(patched(x), want)
        g, got_eps, offset = hnorm.norm_operand(patched)
        assert g.dtype == torch.float32 and torch.equal(g, factor) and got_eps == eps and offset == 0.0
        assert torch.equal(hnorm.prologue_norm(x, g, eps), want) and torch.equal(hnorm.apply_norm(patched, x), want)
        if family == "gemma":
            assert torch.equal(hnorm.reference_gemma_rms_norm(x, stock.weight, eps), want)
        if dtype == torch.bfloat16:
            assert not torch.equal(hnorm.reference_rms_norm(x, stock.weight, eps), want)
    assert f"{cls.OFFSET:g} + weight in fp32" in repr(patched)
    hybridgemm.unpatch(patched)
    assert type(patched) is type(stock)


@pytest.mark.parametrize("family", ["gemma", "olmo2"])
def test_fp32_factor_norms_follow_their_weight_in_inference_and_train_as_stock(family):
    """Eager inference, and the eager operand of the fused step (the kept factor,
    kernel_weight), are bit for bit the stock output, following an in-place change of the
    weight; with gradients the factor is computed in the graph: the same gradients as the
    stock module's."""
    stock, _, _, _ = _fp32_factor_norm(family, torch.bfloat16)
    patched = _patched_gemma(stock)
    x = (torch.randn(3, 96, generator=torch.Generator().manual_seed(4)) * 2).bfloat16()
    with torch.no_grad():
        assert torch.equal(patched(x), stock(x)) and torch.equal(hnorm.apply_norm(patched, x), stock(x))
        assert "_kernel_weight" in patched.__dict__  # apply_norm's eager operand is the kept factor
        stock.weight.add_(0.25)  # (the patched module shares nothing with stock: change both)
        patched.weight.add_(0.25)
        assert torch.equal(patched(x), stock(x)) and torch.equal(hnorm.apply_norm(patched, x), stock(x))
    xs, xp = x.float().requires_grad_(), x.float().requires_grad_()
    stock.float()(xs).square().sum().backward()
    with torch.inference_mode():  # a factor kept from inference mode is not what training uses
        patched.float()(x.float())
    patched(xp).square().sum().backward()
    assert torch.equal(xs.grad, xp.grad) and torch.equal(stock.weight.grad, patched.weight.grad)
    patched.weight.requires_grad_(False)  # frozen (an adapter's training): x's gradient still flows
    xf = x.float().requires_grad_()
    patched(xf).square().sum().backward()
    assert torch.equal(xf.grad, xs.grad)


@pytest.mark.parametrize("family", ["gemma", "olmo2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 96), (2, 17, 96), (333, 96)])
def test_fp32_factor_fast_path_matches_the_stock_module(cpu_fast_path, family, dtype, shape):
    """Eager inference of a patched Gemma / OLMo 2 norm, and the prologue's formula apart, take
    the kernel's fp32_factor form: the stock output but for rare rounding-boundary ties (the
    sum of squares is ordered differently), x's dtype, and in 16 bits unlike Llama's formula."""
    stock, _, factor, eps = _fp32_factor_norm(family, dtype)
    patched = _patched_gemma(stock)
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    with torch.no_grad():
        want = stock(x)
        got, apart = patched(x), hnorm.prologue_norm(x, factor, eps)
    assert cpu_fast_path == [True, True]
    assert got.dtype == dtype and torch.equal(got, apart)
    ulps = 8 if dtype == torch.float32 else 2  # fp32: the sum's order shows in the last bits
    diff = (got.double() - want.double()).abs()
    assert (diff <= ulps * torch.finfo(dtype).eps * want.double().abs() + 1e-30).all()
    if dtype != torch.float32:  # (in fp32 the two formulas are one)
        assert (got != want).float().mean() < 0.02
        rounded_first = hnorm.reference_rms_norm(x, factor.to(dtype), eps)  # Llama's formula
        assert (rounded_first != want).float().mean() > 0.05


@pytest.mark.parametrize("family", ["gemma", "olmo2"])
def test_fp32_factor_operand_eager_and_traced(family, monkeypatch):
    """norm_operand: eager, the kept factor with offset 0; while compiling, the weight itself
    and the class's OFFSET, so that a graph forms no factor. Both operands give the same norm
    apart (prologue_norm) and the same prologue factor (the kernels' ``norm=`` of
    prologue_operand: ``offset + g`` in fp32, or ``g`` as it is), bit for bit; a Llama-style
    norm's operand is its weight with no offset."""
    stock, cls, factor, eps = _fp32_factor_norm(family, torch.bfloat16)
    patched = _patched_gemma(stock)
    x = (torch.randn(5, 96, generator=torch.Generator().manual_seed(6)) * 2).bfloat16()
    eager = hnorm.norm_operand(patched)
    assert eager[0] is patched.kernel_weight() and eager[1:] == (eps, 0.0)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = hnorm.norm_operand(patched)
    assert traced[0] is patched.weight and traced[1:] == (eps, cls.OFFSET)
    monkeypatch.undo()
    with torch.no_grad():
        for g, e, offset in (eager, traced):
            assert torch.equal(hnorm.prologue_norm(x, g, e, offset), stock(x))
            operand = hnorm.prologue_operand(g, e, offset, torch.bfloat16)
            assert operand[0] is g and operand[1] == e  # nothing formed outside the kernel
            kernel_factor = operand[0].float() + (operand[2] if len(operand) == 3 else 0.0)
            assert torch.equal(kernel_factor, factor)
    assert len(hnorm.prologue_operand(eager[0], eps, 0.0, torch.bfloat16)) == 2  # a kept factor as it is
    assert hnorm.prologue_operand(traced[0], eps, traced[2], torch.bfloat16) == (
        (traced[0], eps, 1.0) if family == "gemma" else (traced[0], eps))
    # fp16 x with the bf16 weight: no kernel reads a weight of the other 16-bit dtype, so the
    # fp32 factor is formed here, the same values
    formed, e16 = hnorm.prologue_operand(traced[0], eps, traced[2], torch.float16)
    assert formed.dtype == torch.float32 and e16 == eps and torch.equal(formed, factor)
    assert hnorm.forms_factor(traced[0], traced[2], torch.float16)  # (no bound launch for such a call)
    assert not hnorm.forms_factor(traced[0], traced[2], torch.bfloat16)
    assert not hnorm.forms_factor(traced[0], None, torch.float16)
    llama = patched_copy(stock_norm(dtype=torch.bfloat16))
    assert hnorm.norm_operand(llama) == (llama.weight, EPS, None)
    assert hnorm.prologue_operand(llama.weight, EPS, None, torch.bfloat16) == (llama.weight, EPS)


def test_gemma_kernel_weight_follows_the_weight():
    patched = _patched_gemma(_gemma_norm(torch.float32))
    first = patched.kernel_weight()
    assert patched.kernel_weight() is first  # kept while the weight is unchanged
    with torch.no_grad():
        patched.weight.mul_(-1)  # in place: a new version
    second = patched.kernel_weight()
    assert second is not first and torch.equal(second, 1.0 + patched.weight.detach().float())
    patched.weight.data = torch.zeros(96)  # new storage
    assert torch.equal(patched.kernel_weight(), torch.ones(96))
