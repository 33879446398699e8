"""Per-sample gradients of the capture equal torch.func per-sample gradients of an unsharded copy."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call, grad, vmap

from lightning_longshield.loss import per_sample_token_loss
from lightning_longshield.models import Llama
from lightning_longshield.privacy import PerSampleGradCapture
from tests.support.helpers import small_config


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_capture_matches_torch_func(tie_embeddings):
    torch.manual_seed(0)
    model = Llama(small_config(tie_embeddings=tie_embeddings))
    reference = copy.deepcopy(model)
    input_ids = torch.randint(0, 64, (3, 12))
    labels = torch.randint(0, 64, (3, 12))
    labels[0, :5] = -100

    capture = PerSampleGradCapture(model)
    capture.start_microbatch(3)
    per_sample_token_loss(model(input_ids), labels).sum().backward()
    captured = capture.collect()
    assert all(p.grad is None for p in model.parameters()), "no summed gradient may be formed"

    params = {n: p.detach() for n, p in reference.named_parameters()}  # tied weights appear once

    def sample_loss(params, ids, lab):
        logits = functional_call(reference, params, (ids[None],))
        return per_sample_token_loss(logits, lab[None])[0]

    expected = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, input_ids, labels)
    assert set(captured) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(captured[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_disabled_capture_leaves_autograd_untouched():
    torch.manual_seed(0)
    model = Llama(small_config())
    reference = copy.deepcopy(model)
    capture = PerSampleGradCapture(model)
    ids = torch.randint(0, 64, (1, 8))
    model(ids).sum().backward()
    reference(ids).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    grads = capture.collect()
    assert all(g.shape[0] == 1 for g in grads.values()) and all(p.grad is None for p in model.parameters())


def test_unsupported_layers_are_listed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Conv1d(4, 4, 1), torch.nn.GRU(4, 4))
    with pytest.raises(TypeError, match=r"1 \(Conv1d\); 2 \(GRU\).*Supported layer types: Linear, Embedding"):
        PerSampleGradCapture(model)
    model[1].requires_grad_(False)
    model[2].requires_grad_(False)
    PerSampleGradCapture(model)  # frozen layers need no per-sample gradients


@pytest.mark.parametrize("per_sample", ["materialize", "ghost", "mixed"])
@pytest.mark.parametrize("option", [{"max_norm": 1.0}, {"scale_grad_by_freq": True}], ids=["max_norm", "freq"])
def test_embedding_options_outside_dp_sgd_are_refused_on_every_path(per_sample, option):
    """max_norm renormalises the looked-up rows in place, without noise (the released weights would depend on the
    private batch); scale_grad_by_freq mixes samples' gradients. Both are refused when the capture is built, before
    anything runs, whatever the per-sample method; a frozen embedding with max_norm too (its rows are released)."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, **option), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"0 \(.*\).*Construct the embeddings without max_norm and scale_grad_by_freq"):
        PerSampleGradCapture(model, per_sample=per_sample)
    model[0].requires_grad_(False)
    if "max_norm" in option:
        with pytest.raises(ValueError, match=r"0 \(max_norm=1.0\)"):
            PerSampleGradCapture(model, per_sample=per_sample)
    else:  # a frozen embedding's gradient is never formed
        PerSampleGradCapture(model, per_sample=per_sample)


@pytest.mark.parametrize("norm", [torch.nn.BatchNorm1d(4, affine=False), torch.nn.BatchNorm1d(4).requires_grad_(False),
                                  torch.nn.BatchNorm1d(4, track_running_stats=False),
                                  torch.nn.InstanceNorm1d(4, track_running_stats=True)],
                         ids=["no-affine", "frozen", "batch-statistics", "instance-tracking"])
def test_layers_that_mix_samples_or_keep_batch_statistics_are_refused(norm):
    """BatchNorm, even frozen or without weights, normalises with the batch's statistics (a sample's gradient depends
    on the others drawn with it) and updates running statistics from the sampled batch without noise
    (``num_batches_tracked`` counts the micro-batches), which the model releases; an InstanceNorm tracking running
    statistics does the latter. Refused by name, as Opacus does; before, only trainable layers were checked."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), norm)
    with pytest.raises(ValueError, match=r"1 \(\w+Norm1d\).*Replace them with LayerNorm or RMSNorm"):
        PerSampleGradCapture(model)
    PerSampleGradCapture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.InstanceNorm1d(4)))  # per sample


def test_capture_replaces_forwards_without_hooks_and_is_removable():
    """The capture registers no module hooks (they would send every layer call through `nn.Module`'s slower path):
    it replaces each trainable layer's forward on the instance, calls a forward installed there before it (and not
    `F.linear` in its place), and `remove` puts every layer's own forward back."""
    torch.manual_seed(0)
    model = Llama(small_config())
    calls = []
    own_forward = model.output.forward

    def installed_before(x):
        calls.append(1)
        return own_forward(x)

    model.output.forward = installed_before
    reference = copy.deepcopy(model)
    capture = PerSampleGradCapture(model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    layers = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    assert all("forward" in layer.__dict__ for layer in layers)
    ids = torch.randint(0, 64, (2, 8))
    capture.start_microbatch(2)
    model(ids).sum().backward()
    assert calls == [1] and set(capture.collect()) == {n for n, p in model.named_parameters() if p.requires_grad}
    capture.remove()
    assert model.output.forward is installed_before
    assert not any("forward" in layer.__dict__ for layer in layers if layer is not model.output)
    torch.testing.assert_close(model(ids), reference(ids), rtol=0, atol=0)


@pytest.mark.parametrize("bias", [False, True], ids=["weight", "weight_and_bias"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_a_captured_linear_layer_gives_autograds_input_gradient(bias, autocast):
    """A captured ``nn.Linear`` is one autograd node: the gradient it passes down equals plain autograd's bit for bit,
    in fp32 and under bf16 autocast (computed in bf16, handed on in the input's dtype), and its per-sample gradients
    equal torch.func's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=bias), torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=bias))
    reference = copy.deepcopy(model)
    inputs = torch.randn(3, 5, 8)
    targets = torch.randn(3, 5, 4)

    def loss_and_input_grad(net, capture=None):
        x = inputs.clone().requires_grad_()
        if capture is not None:
            capture.start_microbatch(inputs.shape[0])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = net(x)
        ((out.float() - targets) ** 2).sum().backward()
        return x.grad

    capture = PerSampleGradCapture(model)
    captured_input_grad = loss_and_input_grad(model, capture)
    expected_input_grad = loss_and_input_grad(reference)
    assert captured_input_grad.dtype == torch.float32
    assert torch.equal(captured_input_grad, expected_input_grad)
    captured = capture.collect()
    assert all(p.grad is None for p in model.parameters())
    if autocast:  # bf16 per-sample gradients (the output gradient's dtype): their sum is near autograd's summed one
        for name, param in reference.named_parameters():
            torch.testing.assert_close(captured[name].float().sum(0), param.grad, rtol=2e-2, atol=2e-2)
        return
    params = {n: p.detach() for n, p in reference.named_parameters()}

    def sample_loss(params, x, y):
        return ((functional_call(reference, params, (x[None],)) - y[None]) ** 2).sum()

    expected = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, inputs, targets)
    for name, value in expected.items():
        torch.testing.assert_close(captured[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer", [torch.nn.RMSNorm(8), torch.nn.LayerNorm(8), torch.nn.LayerNorm(8, bias=False)],
                         ids=["rms_norm", "layer_norm", "layer_norm_without_bias"])
@pytest.mark.parametrize("shape", [(3, 5, 8), (3, 8)], ids=["tokens", "no_token_dims"])
def test_normalization_samplers_equal_torch_func_and_opacus(layer, shape):
    """The normalisations' own samplers (product formed in place) give torch.func's per-sample gradients and exactly
    Opacus's values (whose LayerNorm sampler fails on a layer without bias), and never alias the output gradient that
    still flows into the layer's backward."""
    from opacus.grad_sample import GradSampleModule

    from lightning_longshield.privacy.grad_sample.layers import normalization_gradients

    torch.manual_seed(0)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    activation, grad_output = torch.randn(shape), torch.randn(shape)
    params = {name: p.detach() for name, p in layer.named_parameters()}

    def sample_output(params, x, g):
        return (functional_call(layer, params, (x[None],)) * g[None]).sum()

    expected = vmap(grad(sample_output), in_dims=(None, 0, 0))(params, activation, grad_output)
    untouched = grad_output.clone()
    ours = normalization_gradients(layer, activation, grad_output)
    assert torch.equal(grad_output, untouched)
    assert set(ours) == set(dict(layer.named_parameters()).values())
    for name, param in layer.named_parameters():
        torch.testing.assert_close(ours[param], expected[name], rtol=1e-5, atol=1e-6)
        assert ours[param].data_ptr() != grad_output.data_ptr()
    if getattr(layer, "bias", True) is not None:
        opacus = GradSampleModule.GRAD_SAMPLERS[type(layer)](layer, [activation], grad_output.clone())
        assert all(torch.equal(ours[param], opacus[param]) for param in layer.parameters())


@pytest.mark.parametrize(("normalized_shape", "shape", "eps"), [
    (8, (3, 5, 8), 1e-5), (8, (3, 8), None), ((2, 8), (3, 4, 2, 8), 1e-6),
], ids=["tokens", "no_token_dims_default_eps", "two_feature_dims"])
def test_rms_norm_node_equals_the_layer_and_torch_func(normalized_shape, shape, eps):
    """Under capture a plain fp32 ``nn.RMSNorm`` on CPU runs as one node (`PerSampleRMSNorm`): the same output as the
    layer bit for bit, autograd's input gradient, and torch.func's per-sample weight gradient."""
    torch.manual_seed(0)
    layer = torch.nn.RMSNorm(normalized_shape, eps=eps)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    reference = copy.deepcopy(layer)
    inputs, grad_output = torch.randn(shape) * 3, torch.randn(shape)
    capture = PerSampleGradCapture(layer)
    capture.start_microbatch(shape[0])
    x = inputs.clone().requires_grad_()
    output = layer(x)
    assert type(output.grad_fn).__name__ == "PerSampleRMSNormBackward"
    output.backward(grad_output)
    captured = capture.collect()

    x_reference = inputs.clone().requires_grad_()
    expected_output = reference(x_reference)
    expected_output.backward(grad_output)
    assert torch.equal(output, expected_output)
    torch.testing.assert_close(x.grad, x_reference.grad, rtol=1e-5, atol=1e-6)
    params = {name: p.detach() for name, p in reference.named_parameters()}

    def sample_output(params, x, g):
        return (functional_call(reference, params, (x[None],)) * g[None]).sum()

    expected = vmap(grad(sample_output), in_dims=(None, 0, 0))(params, inputs, grad_output)
    torch.testing.assert_close(captured["weight"], expected["weight"], rtol=1e-5, atol=1e-6)
    assert layer.weight.grad is None


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_rms_norm_keeps_the_tap_outside_fp32():
    """A bf16 input (mixed dtypes, or a bf16 layer) takes the layer's own forward behind a tap, as on GPUs."""
    layer = torch.nn.RMSNorm(8)
    capture = PerSampleGradCapture(layer)
    capture.start_microbatch(2)
    output = layer(torch.randn(2, 3, 8, dtype=torch.bfloat16, requires_grad=True))
    assert type(output.grad_fn).__name__ == "PerSampleGradTapBackward"
    output.float().sum().backward()
    assert capture.collect()["weight"].shape == (2, 8)


@pytest.mark.parametrize("bias", [False, True], ids=["weight", "weight_and_bias"])
@pytest.mark.parametrize("shape", [(3, 5, 8), (3, 8), (3, 2, 4, 8)], ids=["tokens", "no_token_dims", "two_token_dims"])
def test_linear_sampler_equals_torch_func_and_opacus(bias, shape):
    """The linear layer's own sampler (one bmm over the tokens) gives torch.func's per-sample gradients and Opacus's
    values (an einsum) to fp32 rounding, contiguous, in the output gradient's dtype."""
    from opacus.grad_sample import GradSampleModule

    from lightning_longshield.privacy.grad_sample.layers import linear_gradients

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 6, bias=bias)
    activation, grad_output = torch.randn(shape), torch.randn(*shape[:-1], 6)
    params = {name: p.detach() for name, p in layer.named_parameters()}

    def sample_output(params, x, g):
        return (functional_call(layer, params, (x[None],)) * g[None]).sum()

    expected = vmap(grad(sample_output), in_dims=(None, 0, 0))(params, activation, grad_output)
    ours = linear_gradients(layer, activation, grad_output)
    opacus = GradSampleModule.GRAD_SAMPLERS[torch.nn.Linear](layer, [activation], grad_output)
    assert set(ours) == set(layer.parameters())
    for name, param in layer.named_parameters():
        assert ours[param].is_contiguous() and ours[param].shape == (3, *param.shape)
        torch.testing.assert_close(ours[param], expected[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours[param], opacus[param], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("total_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_total"])
@pytest.mark.parametrize("padding_idx", [None, 3], ids=["no_padding", "padding"])
def test_embedding_rows_add_exactly_the_samplers_tensor(total_dtype, padding_idx):
    """Adding an embedding's per-sample gradients row by row gives bit for bit what adding the sampler's dense
    ``(B, V, d)`` tensor gives (repeated tokens summed in token order, one rounding into the total's dtype)."""
    from lightning_longshield.privacy.grad_sample.layers import add_embedding_gradients_, per_sample_gradients

    torch.manual_seed(0)
    layer = torch.nn.Embedding(11, 6, padding_idx=padding_idx)
    ids = torch.randint(0, 11, (4, 40))  # 40 tokens over 11 ids: every row repeats
    ids[1, :7] = 3
    grad_output = torch.randn(4, 40, 6)
    head = torch.randn(4, 11, 6).to(total_dtype)
    expected = head.clone().add_(per_sample_gradients(layer, ids, grad_output)[layer.weight])
    add_embedding_gradients_(head, layer, ids, grad_output)
    assert torch.equal(head, expected)
    if padding_idx is not None:
        assert torch.equal(head[:, padding_idx], expected[:, padding_idx])


def test_a_tied_embedding_forms_no_vocabulary_sized_per_sample_tensor():
    """At CP 1 a tied embedding's use is added row by row into the head's per-sample gradient: no op of its backward
    creates a ``(B, V, d)`` tensor, and the per-sample gradients still equal torch.func's (as in
    `test_capture_matches_torch_func`)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from lightning_longshield.privacy.grad_sample import capture as capture_module

    torch.manual_seed(0)
    config = small_config(tie_embeddings=True, vocab_size=97)  # no other weight has 97 x dim elements
    model = Llama(config)
    input_ids, labels = torch.randint(0, 97, (3, 12)), torch.randint(0, 97, (3, 12))
    vocabulary_sized = 3 * config.vocab_size * config.dim
    created = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            inputs = {t.untyped_storage().data_ptr() for t in tensors}
            if (isinstance(out, torch.Tensor) and out.numel() == vocabulary_sized
                    and out.untyped_storage().data_ptr() not in inputs):  # new memory, not a view or in-place op
                created.append(str(func))
            return out

    capture = capture_module.PerSampleGradCapture(model)
    capture.start_microbatch(3)
    loss = per_sample_token_loss(model(input_ids), labels).sum()
    with Sizes():
        loss.backward()
    captured = capture.collect()
    assert created == ["aten.bmm.default"], created  # the head's per-sample gradient only
    assert set(captured) == {n for n, _ in model.named_parameters()}
