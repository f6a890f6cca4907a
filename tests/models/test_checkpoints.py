"""A patched model's checkpoints are stock checkpoints: ``state_dict()`` keys, order and values
are those of the unpatched model, ``save_pretrained`` -> ``from_pretrained`` and a strict
load of a stock state dict are bit-exact, and ``unpatch`` afterwards gives back the stock
modules bit-exactly. Transformers models from tiny configs, random weights, CPU, no downloads."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridgemm
from hybridgemm.models.patching import FusedQKV, HybridConv1D, QKVSlice

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 128
TOL = dict(rtol=1e-5, atol=1e-5)
KINDS = ["llama", "qwen2", "mistral", "gpt2", "bert"]


def _build(kind: str) -> nn.Module:
    """A tiny model of ``kind`` with random weights (eval mode)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    elif kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0))
    elif kind == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64))
    else:
        raise AssertionError(kind)
    return model.eval()


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 9))


def _patch(model: nn.Module, kind: str) -> hybridgemm.PatchReport:
    report = hybridgemm.patch(model)
    if kind == "gpt2":  # per layer: c_attn, c_proj, the MLP, its c_fc and c_proj; the LM head
        assert len(report.patched) == 11 and isinstance(model.transformer.h[0].attn.c_attn, HybridConv1D)
        assert isinstance(model.transformer.h[0].mlp.c_fc, HybridConv1D), report
    else:  # both layers' Q/K/V (and a gated MLP's gate/up) really are fused
        assert len(report.fused_qkv) == 2 and len(report.fused_mlp) == (0 if kind == "bert" else 2), report
    return report


def _assert_same(got: dict, ref: dict) -> None:
    """Same keys in the same order; every tensor bit-equal, same dtype, shape and contiguity."""
    assert list(got) == list(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape, k
        assert got[k].is_contiguous() == ref[k].is_contiguous(), k
        assert torch.equal(got[k], ref[k]), k


def _assert_stock_modules(model: nn.Module) -> None:
    for m in model.modules():
        assert not isinstance(m, (FusedQKV, QKVSlice, HybridConv1D, hybridgemm.HybridLinear)), type(m)
        assert not m._load_state_dict_pre_hooks, type(m)  # the patch's load hook is gone
    assert all(p.is_contiguous() for p in model.parameters())


def _tie_holds(model: nn.Module) -> bool:
    """The LM head shares the embedding's parameter exactly when the config ties them."""
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return tied == bool(model.config.tie_word_embeddings)


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_has_stock_keys_and_values(kind):
    stock = _build(kind)
    patched = copy.deepcopy(stock)
    _patch(patched, kind)
    _assert_same(patched.state_dict(), stock.state_dict())
    assert list(patched.state_dict(keep_vars=True)) == list(stock.state_dict(keep_vars=True))
    assert _tie_holds(patched)
    sd = patched.state_dict()
    for name, parent in patched.named_modules():
        fused = parent._modules.get("qkv_proj")
        if isinstance(fused, FusedQKV):  # q/k/v entries: copies of the rows, each covering its own storage
            storage = fused.weight.untyped_storage().data_ptr()
            for n in fused.names:
                t = sd[f"{name}.{n}.weight"]
                assert t.untyped_storage().data_ptr() != storage
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert not any("qkv_proj" in k for k in sd)


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_round_trip_is_bit_exact(kind, tmp_path):
    stock = _build(kind)
    ref = {k: v.clone() for k, v in stock.state_dict().items()}
    ids = _ids()
    ref_logits = _logits(stock, ids)
    patched = copy.deepcopy(stock)
    _patch(patched, kind)
    torch.testing.assert_close(_logits(patched, ids), ref_logits, **TOL)

    patched.save_pretrained(tmp_path / "patched")
    stock.save_pretrained(tmp_path / "stock")
    files = [safetensors_torch.load_file(tmp_path / d / "model.safetensors") for d in ("stock", "patched")]
    assert files[1].keys() == files[0].keys() and all(torch.equal(files[1][k], files[0][k]) for k in files[0])

    loaded = type(stock).from_pretrained(tmp_path / "patched").eval()
    _assert_same(loaded.state_dict(), ref)
    assert _tie_holds(loaded)
    assert torch.equal(_logits(loaded, ids), ref_logits)  # same weights, same stock code: bit-equal

    _patch(loaded, kind)  # a model loaded from a patched model's checkpoint, patched again
    torch.testing.assert_close(_logits(loaded, ids), ref_logits, **TOL)
    _assert_same(loaded.state_dict(), ref)
    loaded.save_pretrained(tmp_path / "again")
    again = type(stock).from_pretrained(tmp_path / "again").eval()
    _assert_same(again.state_dict(), ref)

    torch.save(patched.state_dict(), tmp_path / "sd.pt")  # q/k/v views share the fused storage in the file
    fresh = _build(kind)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True), strict=True)
    _assert_same(fresh.state_dict(), ref)


@pytest.mark.parametrize("kind", KINDS)
def test_strict_load_of_stock_checkpoint_then_unpatch(kind, tmp_path):
    source = _build(kind)  # the checkpoint's weights
    source.save_pretrained(tmp_path)
    ckpt = safetensors_torch.load_file(tmp_path / "model.safetensors")  # tied copies are not in the file
    ref = {k: v.clone() for k, v in source.state_dict().items()}
    ids = _ids()
    ref_logits = _logits(source, ids)

    target = _build(kind)  # other random weights
    _patch(target, kind)
    assert not torch.equal(_logits(target, ids), ref_logits)
    result = target.load_state_dict(source.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for m in target.modules():
        fused = m._modules.get("qkv_proj")
        if isinstance(fused, FusedQKV):
            name = next(n for n, mm in target.named_modules() if mm is m)
            for attr in ("weight", "bias"):
                if getattr(fused, attr) is not None:
                    expect = torch.cat([ref[f"{name}.{n}.{attr}"] for n in fused.names])
                    assert torch.equal(getattr(fused, attr), expect)
    _assert_same(target.state_dict(), ref)
    torch.testing.assert_close(_logits(target, ids), ref_logits, **TOL)
    assert _tie_holds(target)

    hybridgemm.unpatch(target)
    _assert_stock_modules(target)
    _assert_same(target.state_dict(), ref)
    assert torch.equal(_logits(target, ids), ref_logits)

    # the file as saved (no tied duplicates): strict=False reports only the tied key missing
    other = _build(kind)
    _patch(other, kind)
    result = other.load_state_dict(ckpt, strict=False)
    assert not result.unexpected_keys
    assert all(k not in ckpt and "qkv_proj" not in k for k in result.missing_keys)
    other.tie_weights()
    _assert_same(other.state_dict(), ref)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "bert"])
def test_missing_and_misshapen_parts_reported_under_stock_names(kind):
    source, target = _build(kind), _build(kind)
    _patch(target, kind)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    sd = source.state_dict()
    kname = next(k for k in sd if k.endswith(("k_proj.weight", "key.weight")))
    qname = next(k for k in sd if k.endswith(("q_proj.weight", "query.weight")))

    partial = {k: v for k, v in sd.items() if k != kname}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"" + kname.replace(".", r"\.")):
        target.load_state_dict(partial, strict=True)
    result = target.load_state_dict(partial, strict=False)
    assert result.missing_keys == [kname] and not result.unexpected_keys
    got = target.state_dict()
    assert torch.equal(got[kname], before[kname])  # kept its value
    assert torch.equal(got[qname], sd[qname])  # its neighbours loaded

    bad = dict(sd)
    bad[qname] = sd[qname][:-1]
    with pytest.raises(RuntimeError, match="size mismatch for " + qname.replace(".", r"\.")):
        target.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        target.load_state_dict({**sd, "model.extra.weight": torch.zeros(1)} if kind != "bert"
                               else {**sd, "bert.extra.weight": torch.zeros(1)})


def test_fused_keys_still_load_and_assign_true():
    source, target = _build("qwen2"), _build("qwen2")
    _patch(target, "qwen2")
    sd = source.state_dict()
    # a state dict with fused keys (one q/k/v entry per projection) loads as well
    fused_sd = {}
    for k, v in sd.items():
        if ".q_proj." in k:
            attr = k.rpartition(".")[2]
            base = k.split(".q_proj.")[0]
            fused_sd[f"{base}.qkv_proj.{attr}"] = torch.cat([sd[f"{base}.{p}_proj.{attr}"] for p in "qkv"])
        elif ".k_proj." not in k and ".v_proj." not in k:
            fused_sd[k] = v
    target.load_state_dict(fused_sd, strict=True)
    _assert_same(target.state_dict(), sd)

    # assign=True puts new tensors in place; the replaced linears follow them (unpatch exact)
    third = _build("qwen2")
    _patch(third, "qwen2")
    third.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=True, assign=True)
    _assert_same(third.state_dict(), sd)
    attn = third.model.layers[0].self_attn
    original_q = attn.qkv_proj._originals[0]
    assert original_q.weight.data_ptr() == attn.qkv_proj.weight.data_ptr()
    hybridgemm.unpatch(third)
    _assert_stock_modules(third)
    _assert_same(third.state_dict(), sd)


class Attention(nn.Module):
    def __init__(self, e: int = 16):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(e, e) for _ in range(4))

    def forward(self, x):
        return self.o_proj(self.q_proj(x) * self.k_proj(x) + self.v_proj(x))


def test_meta_model_patched_then_loaded_with_assign():
    stock = Attention()
    with torch.device("meta"):
        model = Attention()
    assert hybridgemm.patch(model).fused_qkv == ["(root)"]
    model.load_state_dict(stock.state_dict(), assign=True)
    assert not model.qkv_proj.weight.is_meta and not model.q_proj.weight.is_meta
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), stock(x), **TOL)
    _assert_same(model.state_dict(), stock.state_dict())
    hybridgemm.unpatch(model)
    _assert_same(model.state_dict(), stock.state_dict())


def test_deepcopy_of_patched_model_loads_and_unpatches():
    stock = _build("llama")
    patched = copy.deepcopy(stock)
    _patch(patched, "llama")
    clone = copy.deepcopy(patched)
    source = _build("llama")
    clone.load_state_dict(source.state_dict(), strict=True)
    _assert_same(clone.state_dict(), source.state_dict())
    _assert_same(patched.state_dict(), stock.state_dict())  # the original is untouched
    hybridgemm.unpatch(clone)
    _assert_stock_modules(clone)
    _assert_same(clone.state_dict(), source.state_dict())


def test_training_trains_the_stock_parameters_and_checkpoints_stay_stock(tmp_path):
    """While patched, ``named_parameters()`` holds the stock parameters under their stock names
    (the q/k/v and gate/up ones are rows of the fused weights); gradients and optimizer state
    live on them; ``state_dict()`` shows the trained values under the stock names."""
    stock = _build("qwen2").train()
    patched = copy.deepcopy(stock)
    _patch(patched, "qwen2")
    names = [n for n, _ in patched.named_parameters()]
    assert names == [n for n, _ in stock.named_parameters()]

    ids = _ids()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (stock, patched)]
    for _ in range(2):
        for m, opt in zip((stock, patched), opts):
            opt.zero_grad()
            m(ids, labels=ids).loss.backward()
            opt.step()
    attn = patched.model.layers[1].self_attn
    assert attn.k_proj.weight.grad is not None and attn.k_proj.weight.grad.abs().sum() > 0
    assert attn.k_proj.weight.data_ptr() == attn.qkv_proj.stacked("weight")[attn.q_proj.out_features:].data_ptr()
    ostate = opts[1].state_dict()
    assert len(ostate["state"]) == len(names)
    assert ostate["state"][names.index("model.layers.1.self_attn.k_proj.weight")]["exp_avg"].shape == \
        attn.k_proj.weight.shape
    opt2 = torch.optim.AdamW(patched.parameters(), lr=1e-2)
    opt2.load_state_dict(ostate)  # an optimizer state dict fits the same patched model
    opt3 = torch.optim.AdamW(stock.parameters(), lr=1e-2)
    opt3.load_state_dict(ostate)  # and the stock model: the parameters are the same list

    trained = patched.state_dict()
    ref = stock.state_dict()
    assert list(trained) == list(ref)
    # The same training as stock, fp32 rounding apart. AdamW divides each gradient by its own
    # running magnitude, so a gradient near zero turns rounding noise into up to a whole step
    # (lr = 1e-2) of difference; 1e-4 is 100x below one step: a wrong or missing gradient fails.
    for k in ref:
        torch.testing.assert_close(trained[k], ref[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")

    patched.eval()
    ids2 = _ids()
    want = _logits(patched, ids2)
    patched.save_pretrained(tmp_path)
    loaded = type(stock).from_pretrained(tmp_path).eval()
    _assert_same(loaded.state_dict(), patched.state_dict())
    torch.testing.assert_close(_logits(loaded, ids2), want, **TOL)
    hybridgemm.unpatch(patched)
    _assert_same(patched.state_dict(), loaded.state_dict())
