"""A model's own forward pre-hooks on the modules that are stage-3 units: torch's
``nn.utils.weight_norm`` and ``nn.utils.spectral_norm`` (HiFi-GAN, VITS, GAN discriminators)
compute ``module.weight`` from the module's parameters in a pre-hook registered when the model
was built, before wrap(). The engine's gather is the first of a unit's pre-hooks, so they read
gathered parameters (they read empty shards when it ran after them). The parametrizations of
``nn.utils.parametrizations`` (Wav2Vec2's positional convolution) are checked beside them.

One 2-rank launch at stage 3, parameters and optimizer on the CPU: training against the
float64 oracle, then ``model(**batch)`` outside the engine against a plain model given the
engine's full_state_dict()."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from reference import Oracle, engine_train, make_config, reference_train
from tiertrain.testing import run_distributed

WORLD, MICRO, STEPS = 2, 4, 3


class HookedNet(nn.Module):
    """Three Linears, each a stage-3 unit of its own: spectral norm and weight norm by hooks,
    orthogonal by parametrization."""

    def __init__(self, copyable: bool = False):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        nn.utils.spectral_norm(self.a)
        nn.utils.weight_norm(self.b)
        nn.utils.parametrizations.orthogonal(self.c)
        if copyable:  # (weight_norm's computed weight cannot be deep-copied; its hook recomputes it)
            del self.b.weight

    def forward(self, x, y):
        h = torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))
        return nn.functional.mse_loss(self.d(h), y)


def _model(copyable: bool = False) -> HookedNet:
    torch.manual_seed(0)
    return HookedNet(copyable)


def _batches(n: int = STEPS) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(MICRO * WORLD, 8, generator=g), "y": torch.randn(MICRO * WORLD, 4, generator=g)}
            for _ in range(n)]


def _config():
    return make_config(zero={"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"},
                       batch={"micro_batch_size": MICRO})


def _run(rank, world):
    losses, params, engine = engine_train(rank, world, _model(), _config(), _batches())
    units = sorted(u.unit.label for u in engine.flat.all_units if not u.unit.resident)
    held_out = _batches(STEPS + 1)[-1]
    engine.module.eval()
    with torch.no_grad():
        outside = float(engine.module(**held_out))
    full = {n: t.clone() for n, t in engine.full_state_dict().items()}
    engine.close()
    return losses, params, units, outside, full


@pytest.mark.timeout(120)
def test_pre_hooks_of_units_read_gathered_parameters():
    oracle = Oracle.run(lambda m: reference_train(m, _config(), _batches()), _model(copyable=True))
    losses, params, units, outside, full = run_distributed(_run, WORLD, timeout=90)[0]
    assert units == ["<root>", "a", "b", "c", "d"], units  # (the hooked modules are units of their own)
    oracle.check(losses, params, "hooked units, stage 3, CPU tier")

    plain = _model(copyable=True).eval()
    plain.load_state_dict(full)
    with torch.no_grad():
        expected = float(plain(**_batches(STEPS + 1)[-1]))
    assert outside == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_a_parametrization_is_part_of_its_module_not_a_block():
    """A parametrization's nn.ModuleList (Wav2Vec2's weight-normed positional convolution) is
    not a list of blocks: neither a stage-3 unit of its own nor a block to checkpoint."""
    transformers = pytest.importorskip("transformers")
    from tiertrain.blocks import model_blocks
    from tiertrain.zero.plan import default_unit_modules

    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2))
    assert nn.utils.parametrize.is_parametrized(model.wav2vec2.encoder.pos_conv_embed.conv)  # (the premise)
    layers = ["wav2vec2.feature_extractor.conv_layers.0", "wav2vec2.feature_extractor.conv_layers.1",
              "wav2vec2.encoder.layers.0", "wav2vec2.encoder.layers.1"]
    assert default_unit_modules(model) == layers
    assert model_blocks(model) == layers


def _weight_norms(rank, world, register_before_wrap):
    from reference import global_batches, make_model, rank_slices

    import tiertrain

    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2})
    model, norms = make_model(n_layers=3), []

    def hook(module, args, output):
        norms.append(float(module.mlp.fc1.weight.norm()))

    if register_before_wrap:
        model.blocks[1].register_forward_hook(hook)
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    if not register_before_wrap:
        engine.module.blocks[1].register_forward_hook(hook)
    batches = global_batches(2, 2 * world)
    try:
        for batch in batches:
            with engine.gathered_parameters():
                expected = float(engine.module.blocks[1].mlp.fc1.weight.norm())
            engine.train_batch(rank_slices(batch, rank, world, 2, 1))
            assert norms[-1] == expected
    finally:
        engine.close()
    return norms


@pytest.mark.timeout(60)
def test_a_forward_hook_registered_before_wrap_reads_the_gathered_unit():
    norms = run_distributed(_weight_norms, WORLD, True, timeout=40)
    assert len(norms[0]) == 2 and norms[0] == norms[1]


@pytest.mark.timeout(60)
def test_a_forward_hook_registered_after_wrap_that_reads_the_unit_is_named():
    from tiertrain.testing import RankFailure

    with pytest.raises(RankFailure, match=r"used parameter 'blocks\.1\.mlp\.fc1\.weight' while its unit 'blocks\.1' "
                                          r"was not gathered.*a forward hook registered after wrap\(\).*register it "
                                          r"before"):
        run_distributed(_weight_norms, WORLD, False, timeout=40)
