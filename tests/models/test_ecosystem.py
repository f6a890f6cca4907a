"""A patched model among the libraries people use with it (CPU): PEFT LoRA adapters attached
after ``patch`` and ``patch`` of a model that already carries them (fusions kept, the adapter
on top), parameters reached by their stock names, safetensors' ``save_model``/``load_model``,
weights that arrive after patching (transformers' loader), ``resize_token_embeddings``.

fp32 on the CPU, so the patched GEMMs are F.linear over the fused weights: what is checked is
the plumbing (which module runs, which weights it reads, what the state dict holds), against
stock PEFT/transformers in the same process. LoRA's B matrices are random (PEFT starts them
at zero, which would hide an adapter that never runs).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import hybridgemm
from hybridgemm.fused_rows import FusedLinears, FusedPart, FusedSlice
from hybridgemm.linear_layer import HybridLinear

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 97


def _config(tie: bool = False):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                                    max_position_embeddings=64)


def _stock(tie: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_config(tie)).eval()


def _lora(model, targets=ALL, seed: int = 1, name: str = "default", r: int = 4):
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False)
    torch.manual_seed(seed)
    if isinstance(model, peft.PeftModel):
        model.add_adapter(name, cfg)
        return model
    return peft.get_peft_model(model, cfg, adapter_name=name)


def _ids(batch: int = 2, length: int = 7, seed: int = 3):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def gemms(monkeypatch):
    """Counts the fused GEMMs (FusedLinears.forward) run."""
    count = {"n": 0}
    real = FusedLinears.forward

    def forward(self, x):
        count["n"] += 1
        return real(self, x)

    monkeypatch.setattr(FusedLinears, "forward", forward)
    return count


def _attn(model, layer: int = 0):
    return model.get_base_model().model.layers[layer].self_attn


# ----------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("targets", [ALL, ["q_proj", "v_proj", "gate_proj"]], ids=["all7", "q-v-gate"])
def test_lora_attached_after_patch_runs_on_the_fused_gemms(targets, gemms):
    stock = _stock()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ref, got = _lora(stock, targets), _lora(patched, targets)
    q = _attn(got).q_proj
    assert type(q).__name__ == "Linear" and type(q.base_layer) is FusedSlice
    ids = _ids()
    out = _logits(got, ids)
    assert gemms["n"] == 2 * 2  # one Q/K/V and one gate/up GEMM per layer, the adapters on top
    assert torch.allclose(out, _logits(ref, ids), rtol=1e-5, atol=1e-5)
    with got.disable_adapter():  # the adapters do change the result: they ran
        assert not torch.allclose(_logits(got, ids), out, rtol=1e-3, atol=1e-3)


def test_lora_training_step_gives_stock_peft_gradients():
    stock = _stock()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ref, got = _lora(stock), _lora(patched)
    ids = _ids()
    grads = []
    for m in (ref, got):
        m.train()
        m(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) == 2 * 2 * len(ALL)  # A and B of each adapter
    for n, g in grads[0].items():
        assert torch.allclose(grads[1][n], g, rtol=1e-4, atol=1e-6), n
    assert not any(p.requires_grad for n, p in got.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("safe", [False, True], ids=["merge", "safe_merge"])
def test_merge_unmerge_and_unload_keep_the_fused_modules(safe):
    stock = _stock()
    plain = copy.deepcopy(stock)  # get_peft_model adds the adapters in place: a copy without them
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    got = _lora(patched)
    ids = _ids()
    before = _logits(got, ids)
    got.merge_adapter(safe_merge=safe)
    assert torch.allclose(_logits(got, ids), before, rtol=1e-4, atol=1e-4)
    fused = _attn(got).qkv_proj.weight
    assert not torch.allclose(fused[:64], plain.model.layers[0].self_attn.q_proj.weight)  # the delta is in it
    got.unmerge_adapter()
    assert torch.allclose(fused[:64], plain.model.layers[0].self_attn.q_proj.weight, atol=1e-6)
    with got.disable_adapter():
        assert torch.allclose(_logits(got, ids), _logits(plain, ids), rtol=1e-4, atol=1e-4)
    unloaded = got.merge_and_unload(safe_merge=safe)
    assert type(unloaded.model.layers[0].self_attn.q_proj) is FusedSlice
    assert torch.allclose(_logits(unloaded, ids), before, rtol=1e-4, atol=1e-4)


def test_switching_between_two_adapters():
    stock = _stock()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ref, got = _lora(stock, seed=1), _lora(patched, seed=1)
    _lora(ref, seed=2, name="other")
    _lora(got, seed=2, name="other")
    ids = _ids()
    for name in ("other", "default", "other"):
        ref.set_adapter(name)
        got.set_adapter(name)
        assert torch.allclose(_logits(got, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5), name


def test_patch_of_a_model_with_adapters_fuses_under_them(gemms):
    stock = _lora(_stock())
    patched = copy.deepcopy(stock)
    report = hybridgemm.patch(patched)
    assert len(report.fused_qkv) == len(report.fused_mlp) == 2
    attn = _attn(patched)
    assert type(attn.q_proj.base_layer) is FusedSlice and isinstance(attn.qkv_proj, FusedLinears)
    assert type(attn.o_proj.base_layer) is HybridLinear
    # the layers take the fused decode step (it adds the LoRA terms itself); LoRA's own A/B
    # linears are the adapter's, not listed as unpatched
    assert len(report.fused_layers) == 2
    assert not any("lora_" in name for name, _ in report.skipped)
    assert not any("adapter" in why for _, why in report.skipped), report.skipped
    ids = _ids()
    assert torch.allclose(_logits(patched, ids), _logits(stock, ids), rtol=1e-5, atol=1e-5)
    assert gemms["n"] == 2 * 2
    sd, ref = patched.state_dict(), stock.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    other = copy.deepcopy(stock)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    patched.load_state_dict(other.state_dict())  # stock keys, through the adapters, into the fused weights
    assert torch.allclose(_logits(patched, ids), _logits(other, ids), rtol=1e-5, atol=1e-5)
    hybridgemm.unpatch(patched)
    assert type(_attn(patched).q_proj.base_layer) is torch.nn.Linear


def test_an_adapter_the_step_does_not_compute_gives_the_layer_forward(monkeypatch):
    from hybridgemm.models import decode_checks

    patched = copy.deepcopy(_stock())
    hybridgemm.patch(patched)
    layer = patched.model.layers[0]
    monkeypatch.setattr(decode_checks, "on_kernel_device", lambda x: True)  # as on a GPU
    x = torch.randn(1, 1, 64)
    assert decode_checks._parts_in_place(layer)
    _lora(patched, ["v_proj"])
    assert decode_checks._parts_in_place(layer)  # plain LoRA: the step adds its terms (test_lora_decode_step.py)
    layer.self_attn.v_proj.lora_variant["default"] = object()  # a LoRA variant (DoRA, ...): not computed
    assert not decode_checks._parts_in_place(layer)
    assert not decode_checks.takes_fused_path(layer, x)


# ----------------------------------------------------------------------------- names


def test_stock_parameter_names_are_the_parameters():
    stock = _stock()
    model = copy.deepcopy(stock)
    q_before = model.model.layers[0].self_attn.q_proj.weight
    hybridgemm.patch(model)
    attn = model.model.layers[0].self_attn
    stacked = attn.qkv_proj.stacked("weight")
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in stock.named_parameters()]  # the stock names, in the stock order
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in stock.parameters())
    k = model.get_parameter("model.layers.0.self_attn.k_proj.weight")
    assert type(k) is FusedPart and k.is_leaf and k.shape == (32, 64)
    assert k.data_ptr() == stacked[64:96].data_ptr()  # its rows of the one GEMM's weight: no copy
    assert attn.q_proj.weight is q_before  # the replaced linear's own parameter object
    assert type(k * 2) is torch.Tensor  # operations give plain tensors
    fresh = torch.randn(32, 64)
    k.data = fresh  # as stock code (and PEFT's safe merge) replaces a parameter's values
    assert torch.equal(stacked[64:96], fresh) and k.data_ptr() == stacked[64:96].data_ptr()
    with pytest.raises(ValueError, match="takes data of shape"):
        attn.k_proj.weight.data = torch.randn(3, 64)


def test_freezing_by_name_trains_only_the_other_parts():
    stock = _stock()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ids = _ids()
    steps = []
    for m in (stock, patched):
        for n, p in m.named_parameters():
            p.requires_grad_("q_proj" not in n and "up_proj" not in n)  # freeze by name
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m.train()
        m(ids, labels=ids).loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters()}
        opt.step()
        steps.append((grads, {n: p.detach().clone() for n, p in m.named_parameters()}))
    (g_ref, after_ref), (g_got, after_got) = steps
    assert [n for n, g in g_got.items() if g is None] == [n for n, g in g_ref.items() if g is None]
    assert any("q_proj" in n for n, g in g_got.items() if g is None)
    for n, g in g_ref.items():
        if g is not None:
            assert torch.allclose(g_got[n], g, rtol=1e-4, atol=1e-6), n
    for n, w in after_ref.items():
        assert torch.allclose(after_got[n], w, rtol=1e-5, atol=1e-6), n
    layer = patched.model.layers[0]
    q, k = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
    stacked = layer.self_attn.qkv_proj.stacked("weight")
    assert torch.equal(stacked[:64], stock.model.layers[0].self_attn.q_proj.weight.detach())  # frozen: untouched
    assert torch.equal(stacked[64:96], k.detach()) and not q.requires_grad and k.requires_grad
    patched.eval()
    assert torch.allclose(_logits(patched, ids), _logits(stock, ids), rtol=1e-4, atol=1e-5)  # the GEMM reads them


def test_compiled_training_step_with_a_part_frozen_by_name():
    torch._dynamo.reset()
    stock = _stock().train()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ids = _ids()
    for m in (stock, patched):
        for n, p in m.named_parameters():
            p.requires_grad_("k_proj" not in n)
    stock(ids, labels=ids).loss.backward()
    torch.compile(patched, fullgraph=True, backend="aot_eager")(ids, labels=ids).loss.backward()
    got = dict(patched.named_parameters())
    for n, p in stock.named_parameters():
        assert (p.grad is None) == (got[n].grad is None), n
        if p.grad is not None:
            assert torch.allclose(got[n].grad, p.grad, rtol=1e-4, atol=1e-6), n
    assert got["model.layers.0.self_attn.k_proj.weight"].grad is None


def test_an_optimizer_built_before_patch_keeps_training_the_model():
    stock = _stock()
    patched = copy.deepcopy(stock)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (stock, patched)]
    hybridgemm.patch(patched)
    ids = _ids()
    for m, opt in zip((stock, patched), opts):
        m.train()
        for _ in range(2):
            opt.zero_grad()
            m(ids, labels=ids).loss.backward()
            opt.step()
    sd_ref, sd_got = stock.state_dict(), patched.state_dict()
    for n, w in sd_ref.items():
        assert torch.allclose(sd_got[n], w, rtol=1e-4, atol=1e-5), n
    assert not torch.equal(sd_got["model.layers.0.self_attn.v_proj.weight"],
                           _stock().state_dict()["model.layers.0.self_attn.v_proj.weight"])


def test_moves_and_copies_keep_the_parts_in_the_stacked_rows():
    model = _stock()
    hybridgemm.patch(model)
    ids = _ids()
    ref = _logits(model, ids).double()
    model.double()
    attn = model.model.layers[1].self_attn
    stacked = attn.qkv_proj.stacked("weight")
    assert stacked.dtype == torch.float64 and attn.v_proj.weight.data_ptr() == stacked[96:].data_ptr()
    twin = copy.deepcopy(model)
    t_attn = twin.model.layers[1].self_attn
    assert t_attn.k_proj.weight.data_ptr() == t_attn.qkv_proj.stacked("weight")[64:96].data_ptr()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    l_attn = loaded.model.layers[1].self_attn
    assert type(l_attn.k_proj.weight) is FusedPart
    assert l_attn.k_proj.weight.data_ptr() == l_attn.qkv_proj.stacked("weight")[64:96].data_ptr()
    for m in (model, twin, loaded):
        assert torch.allclose(_logits(m, ids), ref, rtol=1e-5, atol=1e-6)
    # a part put in place as accelerate's loaders put one (a new parameter object straight into
    # the slice's _parameters): stacked anew before the next GEMM
    from accelerate.utils import set_module_tensor_to_device

    set_module_tensor_to_device(attn.q_proj, "weight", "cpu", value=attn.q_proj.weight.detach() * 2)
    doubled = attn.qkv_proj.stacked("weight")
    assert doubled.data_ptr() != stacked.data_ptr() and torch.equal(doubled[:64], attn.q_proj.weight.detach())
    assert type(attn.q_proj.weight) is FusedPart and torch.equal(doubled[:64], 2 * stacked[:64])


# ----------------------------------------------------------------------------- safetensors


def test_safetensors_save_model_and_load_model_round_trip(tmp_path):
    from safetensors.torch import load_file, load_model, save_model

    stock = _stock()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    save_model(patched, tmp_path / "p.safetensors")
    on_disk = load_file(tmp_path / "p.safetensors")
    ref = stock.state_dict()
    assert set(on_disk) == set(ref) and all(torch.equal(on_disk[k], ref[k]) for k in ref)
    target = _stock(seed=9)
    hybridgemm.patch(target)
    missing, unexpected = load_model(target, tmp_path / "p.safetensors")
    assert not missing and not unexpected
    ids = _ids()
    assert torch.equal(_logits(target, ids), _logits(patched, ids))
    sd = target.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


def test_state_dict_entries_of_fused_parts_are_tensors_of_their_own():
    model = _stock()
    hybridgemm.patch(model)
    sd = model.state_dict()
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    fused = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(q, fused[:64]) and q.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr()
    assert q.untyped_storage().nbytes() == q.numel() * q.element_size()
    kept = model.state_dict(keep_vars=True)["model.layers.0.self_attn.q_proj.weight"]
    assert kept.data_ptr() == fused.data_ptr() and kept.requires_grad  # keep_vars: the rows themselves


# ----------------------------------------------------------------------------- loading order


class PatchedAtConstruction(transformers.LlamaForCausalLM):
    """A model class that patches itself when built: transformers' loader then sets each
    weight of the already fused model."""

    def __init__(self, config):
        super().__init__(config)
        hybridgemm.patch(self)


def test_transformers_loader_fills_a_model_patched_before_its_weights(tmp_path):
    stock = _stock()
    stock.save_pretrained(tmp_path)
    model = PatchedAtConstruction.from_pretrained(tmp_path).eval()
    attn = model.model.layers[1].self_attn
    assert type(attn.k_proj) is FusedSlice and not attn.qkv_proj.weight.is_meta
    sd, ref = model.state_dict(), stock.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)  # nothing re-initialised after loading
    ids = _ids()
    assert torch.allclose(_logits(model, ids), _logits(stock, ids), rtol=1e-5, atol=1e-5)


def test_a_missing_weight_is_initialised_into_its_rows(tmp_path):
    from safetensors.torch import load_file, save_file

    stock = _stock()
    stock.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    del sd["model.layers.0.self_attn.v_proj.weight"]
    save_file(sd, path, metadata={"format": "pt"})
    model = PatchedAtConstruction.from_pretrained(tmp_path).eval()
    attn = model.model.layers[0].self_attn
    v, k = attn.qkv_proj.stacked("weight")[96:], attn.qkv_proj.stacked("weight")[64:96]
    assert torch.equal(k, stock.model.layers[0].self_attn.k_proj.weight)
    assert float(v.std()) > 0 and not torch.equal(v, stock.model.layers[0].self_attn.v_proj.weight)


def test_assigning_a_part_checks_it():
    model = _stock()
    hybridgemm.patch(model)
    attn = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match="size mismatch for k_proj.weight"):
        attn.k_proj.weight = torch.nn.Parameter(torch.zeros(31, 64))
    with pytest.raises(ValueError, match="cannot remove bias"):
        attn.k_proj.bias = None
    with pytest.raises(TypeError, match="torch.Tensor expected"):
        attn.k_proj.weight = "nope"
    new = torch.nn.Parameter(torch.full((32, 64), 2.0, dtype=torch.float64))  # another dtype: the fused weight follows
    attn.k_proj.weight = new
    assert attn.qkv_proj.weight.dtype == torch.float64 and torch.equal(attn.qkv_proj.weight[64:96], new.detach())
    assert torch.equal(attn.qkv_proj.weight[:64].float(), model.model.layers[0].self_attn.q_proj.weight.float())


def test_meta_model_patched_then_filled_by_assignment():
    stock = _stock()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config())
    hybridgemm.patch(model)
    for name, t in stock.state_dict().items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, torch.nn.Parameter(t.clone()))
    model.eval()
    for n, b in model.named_buffers():  # rotary tables: made anew, as for any meta-built model
        owner, _, attr = n.rpartition(".")
        if b.is_meta:
            model.get_submodule(owner)._buffers[attr] = dict(stock.named_buffers()).get(n, torch.zeros(b.shape))
    ids = _ids()
    assert torch.allclose(_logits(model, ids), _logits(stock, ids), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- embeddings


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_resize_token_embeddings_keeps_the_patched_head(tie):
    stock = _stock(tie)
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    for m in (stock, patched):
        torch.manual_seed(4)
        m.resize_token_embeddings(VOCAB + 13, mean_resizing=False)
    head = patched.lm_head
    assert type(head) is HybridLinear and head.weight.shape == (VOCAB + 13, 64)
    assert (head.weight is patched.model.embed_tokens.weight) == tie
    ids = torch.randint(0, VOCAB + 13, (2, 5), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(_logits(patched, ids), _logits(stock, ids), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(patched)  # the replacement method belongs to each copy
    assert twin.__dict__["resize_token_embeddings"].model is twin
    buf = io.BytesIO()
    torch.save(patched, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded.resize_token_embeddings(VOCAB + 20, mean_resizing=False)
    assert type(loaded.lm_head) is HybridLinear and loaded.lm_head.weight.shape[0] == VOCAB + 20
    hybridgemm.unpatch(patched)
    assert type(patched.lm_head) is torch.nn.Linear and "resize_token_embeddings" not in patched.__dict__


def test_resize_with_an_fp8_head_says_to_resize_first():
    model = _stock()
    hybridgemm.patch(model, weights="fp8", quantize_lm_head=True)
    with pytest.raises(ValueError, match="resize the embeddings before patching"):
        model.resize_token_embeddings(VOCAB + 3)
    assert model.lm_head.weight.shape[0] == VOCAB


def test_functional_call_runs_the_given_tensors_and_leaves_the_module_as_it_was():
    from torch.func import functional_call

    stock = _stock()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ids = _ids()
    before = _logits(patched, ids)
    g = torch.Generator().manual_seed(7)
    params = {n: torch.randn(p.shape, generator=g) * 0.05 for n, p in stock.named_parameters()}
    with torch.no_grad():
        want = functional_call(stock, params, (ids,)).logits
        got = functional_call(patched, params, (ids,)).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5) and not torch.allclose(got, before, atol=1e-2)
    assert torch.equal(_logits(patched, ids), before)  # its own parameters are back, and the GEMM reads them
    ps = {n: t.clone().requires_grad_() for n, t in params.items()}
    functional_call(patched, ps, (ids,)).logits.square().mean().backward()
    ref = {n: t.clone().requires_grad_() for n, t in params.items()}
    functional_call(stock, ref, (ids,)).logits.square().mean().backward()
    for n, t in ref.items():
        assert torch.allclose(ps[n].grad, t.grad, rtol=1e-4, atol=1e-6), n
    assert torch.equal(_logits(patched, ids), before)


class _RowNormalized(torch.nn.Module):
    """A parametrization that changes every value (weight normalisation without its gain)."""

    def forward(self, w):
        return w / w.norm(dim=1, keepdim=True)


@pytest.mark.parametrize("name", ["k_proj", "gate_proj", "o_proj"])  # fused Q/K/V, fused gate/up, swapped class
def test_a_parametrization_registered_after_patch_runs_trains_saves_and_survives_unpatch(name):
    from torch.nn.utils import parametrize

    stock = _stock()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)

    def module(model):
        layer = model.model.layers[1]
        return getattr(layer.self_attn if name.endswith(("k_proj", "o_proj")) else layer.mlp, name)

    for model in (stock, patched):
        parametrize.register_parametrization(module(model), "weight", _RowNormalized())
    ids = _ids()
    want = _logits(stock, ids)
    assert torch.allclose(_logits(patched, ids), want, rtol=1e-5, atol=1e-5)
    for model in (stock, patched):
        model(ids).logits.square().mean().backward()
    grads = [module(m).parametrizations.weight.original.grad for m in (stock, patched)]
    assert grads[1] is not None and torch.allclose(grads[1], grads[0], rtol=1e-4, atol=1e-7)
    compiled = torch.compile(patched, backend="eager")  # the parametrization traced into the graph
    assert torch.allclose(_logits(compiled, ids), want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    for model in (stock, patched):  # a move or cast after parametrizing keeps it in force
        model.double().float()
    assert torch.allclose(_logits(patched, ids), want, rtol=1e-5, atol=1e-5)
    state = patched.state_dict()
    assert list(state) == list(stock.state_dict())
    reloaded = _stock(seed=5)
    parametrize.register_parametrization(module(reloaded), "weight", _RowNormalized())
    reloaded.load_state_dict(state)
    assert torch.equal(_logits(reloaded, ids), want)

    assert hybridgemm.unpatch(patched)
    restored = module(patched)
    assert type(restored).__name__ == "ParametrizedLinear" and parametrize.is_parametrized(restored, "weight")
    original = restored.parametrizations.weight.original
    assert type(original) is torch.nn.Parameter and not isinstance(original, FusedPart)
    assert torch.allclose(_logits(patched, ids), want, rtol=1e-5, atol=1e-5)
    parametrize.remove_parametrizations(restored, "weight")
    assert type(module(patched)) is torch.nn.Linear
    assert torch.allclose(_logits(patched, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("swap", [False, True], ids=["set_", "swap_tensors"])
@pytest.mark.parametrize("leave", [True, False], ids=["leave_parametrized", "original"])
@pytest.mark.parametrize("name", ["k_proj", "up_proj"])
def test_removing_a_parametrization_from_a_fused_slice_while_patched_gives_the_gemm_its_values(name, leave, swap,
                                                                                              monkeypatch):
    """``remove_parametrizations`` on a fused slice while the model stays patched: the GEMM reads
    what stock's linear then holds (with ``leave_parametrized=True`` the computed values, which
    torch puts into the original parameter's storage by ``set_``, or by ``torch.utils.swap_tensors``
    under ``torch.__future__.set_swap_module_params_on_conversion(True)``; else the original's own
    values)."""
    from torch.nn.utils import parametrize

    monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", swap)
    assert torch.__future__.get_swap_module_params_on_conversion() is swap
    stock = _stock()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ids = _ids()

    def module(model):
        layer = model.model.layers[0]
        return getattr(layer.self_attn if name == "k_proj" else layer.mlp, name)

    for model in (stock, patched):
        _logits(model, ids)  # the fused module's parts checked in their rows
        parametrize.register_parametrization(module(model), "weight", _RowNormalized())
        if name == "k_proj":  # (gate/up: removed before any forward reads the parametrization)
            _logits(model, ids)
        parametrize.remove_parametrizations(module(model), "weight", leave_parametrized=leave)
    assert not parametrize.is_parametrized(module(patched))
    want = _logits(stock, ids)
    assert not torch.allclose(want, _logits(_stock(), ids), rtol=1e-3, atol=1e-3) or not leave
    assert torch.allclose(_logits(patched, ids), want, rtol=1e-5, atol=1e-5)
    assert hybridgemm.unpatch(patched)
    assert torch.allclose(_logits(patched, ids), want, rtol=1e-5, atol=1e-5)


class _Shifted(torch.nn.Module):
    def forward(self, t):
        return 3 * t + 0.5


def test_a_bias_parametrization_removed_while_the_weight_keeps_its_own_reaches_the_gemm():
    """A fused Q/K/V with biases (Qwen2's), k_proj's weight and bias parametrized, then the bias's
    parametrization removed with its values left: the GEMM adds k_proj's new bias while its
    weight is still computed per call; then the weight's removed too."""
    import transformers
    from torch.nn.utils import parametrize

    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, vocab_size=97, max_position_embeddings=64)
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in stock.named_parameters():
            if n.endswith("bias"):
                p.normal_()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ids = _ids()

    def k_proj(model):
        return model.model.layers[0].self_attn.k_proj

    assert type(k_proj(patched)).__name__ == "FusedSlice"
    for model in (stock, patched):
        _logits(model, ids)
        for attr in ("weight", "bias"):
            parametrize.register_parametrization(k_proj(model), attr, _Shifted())
        _logits(model, ids)
        parametrize.remove_parametrizations(k_proj(model), "bias", leave_parametrized=True)
    want = _logits(stock, ids)
    assert torch.allclose(_logits(patched, ids), want, rtol=1e-5, atol=1e-5)
    for model in (stock, patched):
        parametrize.remove_parametrizations(k_proj(model), "weight", leave_parametrized=True)
    assert torch.allclose(_logits(patched, ids), _logits(stock, ids), rtol=1e-5, atol=1e-5)


class _Halved(torch.nn.Module):
    """A parametrization with a right inverse: assigning the weight stores half of it."""

    def forward(self, w):
        return 2 * w

    def right_inverse(self, w):
        return w / 2


def test_assigning_a_parametrized_fused_slices_weight_goes_through_its_right_inverse():
    from torch.nn.utils import parametrize

    stock = _stock()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    new = torch.randn(32, 64, generator=torch.Generator().manual_seed(4)) * 0.05
    for model in (stock, patched):
        k = model.model.layers[0].self_attn.k_proj
        parametrize.register_parametrization(k, "weight", _Halved())
        k.weight = new
        assert torch.allclose(k.weight, new) and torch.allclose(k.parametrizations.weight.original, new / 2)
    ids = _ids()
    assert torch.allclose(_logits(patched, ids), _logits(stock, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("patched", [False, True], ids=["stock", "patched"])
def test_an_in_place_step_between_forward_and_backward_raises_as_for_stock(patched):
    model = _stock()
    if patched:
        hybridgemm.patch(model)
    model.train()
    out = model(_ids(), labels=_ids()).loss
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(2)  # an optimizer step before the backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_inference_mode_gives_stock_logits():
    stock = _stock()
    patched = copy.deepcopy(stock)
    hybridgemm.patch(patched)
    ids = _ids()
    with torch.inference_mode():
        assert torch.allclose(patched(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
