"""Complex tensors in a user's model: a trainable complex parameter is refused by name, the
real view it names as the remedy trains as the complex parameter does, and frozen complex
tensors (a rotary ``freqs_cis`` buffer, a fixed complex filter) are held as stored.

A Fourier layer's spectral weights (FNO-style models) are complex parameters. The engine keeps
real fp32 masters and real flat buffers, so such a parameter was cast to one: its imaginary part
was dropped with only torch's "discards the imaginary part" warning, the model trained without
it, and ``full_state_dict()`` returned a real tensor. torch's optimizers step a complex
parameter as its ``view_as_real`` (AdamW's moments, weight decay, and clip_grad_norm_'s norm
are those of the real view), so holding the weight as that real view and taking
``view_as_complex`` in forward trains the same values.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tiertrain
from tiertrain.config import ConfigError
from tiertrain.optim import param_groups
from tiertrain.testing import run_distributed
from reference import Oracle, engine_train, make_config, reference_train

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

WIDTH, SEQ, MODES, STEPS, GLOBAL_BATCH = 8, 16, 5, 3, 8


class SpectralBlock(nn.Module):
    """FNO's spectral convolution over the sequence: the first MODES Fourier modes of each
    channel mixed by complex weights. real_view: the weights held as a real (..., 2) parameter."""

    def __init__(self, real_view: bool):
        super().__init__()
        weights = torch.randn(WIDTH, WIDTH, MODES, dtype=torch.complex64) / WIDTH
        self.real_view = real_view
        self.weights = nn.Parameter(torch.view_as_real(weights).clone() if real_view else weights)
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        weights = torch.view_as_complex(self.weights) if self.real_view else self.weights
        spectrum = torch.fft.rfft(h.transpose(1, 2).float(), dim=-1)
        mixed = torch.zeros_like(spectrum)
        mixed[..., :MODES] = torch.einsum("bim,iom->bom", spectrum[..., :MODES], weights.to(spectrum.dtype))
        spectral = torch.fft.irfft(mixed, n=h.shape[1], dim=-1).transpose(1, 2).to(h.dtype)
        return h + torch.tanh(spectral + self.mix(h))


class FourierNet(nn.Module):
    def __init__(self, real_view: bool, freeze_spectral: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.lift = nn.Linear(1, WIDTH)
        self.layers = nn.ModuleList([SpectralBlock(real_view) for _ in range(2)])
        self.project = nn.Linear(WIDTH, 1)
        for layer in self.layers:
            layer.weights.requires_grad_(not freeze_spectral)

    def forward(self, x, y):
        h = self.lift(x)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.mse_loss(self.project(h).float(), y)


def _batches():
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(GLOBAL_BATCH, SEQ, 1, generator=g), "y": torch.randn(GLOBAL_BATCH, SEQ, 1, generator=g)}
            for _ in range(STEPS)]


def _config(world: int = 2, **sections):
    return make_config(batch={"micro_batch_size": GLOBAL_BATCH // world}, **sections)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_trainable_complex_parameter_is_refused_by_name_with_its_real_view_as_remedy(stage):
    config = make_config(zero={"stage": stage})
    with pytest.raises(ConfigError, match=r"'layers\.0\.weights \(torch\.complex64\)', 'layers\.1\.weights "
                                          r"\(torch\.complex64\)' are trainable complex parameters.*imaginary part.*"
                                          r"nn\.Parameter\(torch\.view_as_real\(weight\)\).*view_as_complex"):
        tiertrain.wrap(FourierNet(real_view=False), config, tiertrain.Topology.build(config.parallel))


def test_the_real_view_trains_as_torch_trains_the_complex_parameter():
    """The remedy the error names, in one process: AdamW (its single-tensor kernel; the fused
    one takes no complex parameter) with clipping over the complex model, and over the model
    holding the real view, give the same values to the last bits of clip's norm."""
    config = _config()

    def adamw(model):
        o = config.optimizer
        return torch.optim.AdamW(param_groups(model.named_parameters(), o), lr=o.lr, betas=o.betas, eps=o.eps,
                                 weight_decay=o.weight_decay, foreach=False)

    complex_losses, complex_params = reference_train(FourierNet(real_view=False), config, _batches(), adamw)
    real_losses, real_params = reference_train(FourierNet(real_view=True), config, _batches(), adamw)
    torch.testing.assert_close(real_losses, complex_losses, rtol=1e-6, atol=0)
    for name, value in complex_params.items():
        expected = torch.view_as_real(value) if value.is_complex() else value
        torch.testing.assert_close(real_params[name], expected, rtol=1e-5, atol=1e-7, msg=name)


def _ranks(rank, world, zero, real_view, freeze_spectral, dtype):
    config = _config(world, zero=zero, precision={"dtype": dtype})
    losses, params, engine = engine_train(rank, world, FourierNet(real_view, freeze_spectral), config, _batches())
    engine.close()
    return losses, params


@pytest.mark.parametrize("zero", [{"stage": 2}, {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"}],
                         ids=["stage2", "stage3-cpu"])
def test_the_real_view_trains_on_two_ranks_as_in_one_process(zero):
    oracle = Oracle.run(lambda model: reference_train(model, _config(), _batches()), FourierNet(real_view=True))
    losses, params = run_distributed(_ranks, 2, zero, True, False, "fp32", timeout=90)[0]
    oracle.check(losses, params, f"real-view spectral weights {zero}")


def test_frozen_complex_parameters_are_held_as_stored_at_bf16():
    """A frozen complex parameter is neither cast to bf16 nor taken for a master: it keeps its
    values and dtype through stage 3, and the rest trains as in one process (fp32: the oracle)."""
    frozen = FourierNet(real_view=False, freeze_spectral=True)
    oracle = Oracle.run(lambda model: reference_train(model, _config(), _batches()), frozen)
    losses, params = run_distributed(_ranks, 2, {"stage": 3}, False, True, "fp32", timeout=90)[0]
    oracle.check(losses, {n: v for n, v in params.items() if not v.is_complex()}, "frozen complex, fp32")
    _, params = run_distributed(_ranks, 2, {"stage": 3}, False, True, "bf16", timeout=90)[0]
    for name, value in frozen.named_parameters():
        if value.is_complex():
            assert params[name].dtype == torch.complex64 and torch.equal(params[name], value.detach()), name
