"""Memory-centric tiling: the tiled layer equals the untiled one, and under ZeRO-3 the
parameter working memory of a large linear falls in proportion to the tile count."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tiertrain
from reference import Oracle, assert_within_rounding, make_config, reference_train
from tiertrain.testing import run_distributed
from tiertrain.tiling import TiledLinear, apply_tiling


@pytest.mark.parametrize("tiles", [1, 3, 8])
def test_tiled_linear_equals_linear_in_output_and_gradients(tiles):
    """Tiled and untiled are two fp32 evaluations of the same sums of products (the tiled
    input gradient adds per-tile partial sums: another association of the same 40 terms).
    Each must lie within the rounding bound γ_n·Σ|terms| of the float64 result, where n is
    the length of the sum: in_features + 1 (bias) for the output, out_features for the input
    gradient, the 35 rows for the weight and bias gradients."""
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    tiled = TiledLinear.from_linear(linear, tiles)
    x = torch.randn(5, 7, 24, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = linear(x), tiled(x2)
    grad = torch.randn_like(y)
    y.backward(grad)
    y2.backward(grad)
    w, b = linear.weight.detach().double(), linear.bias.detach().double()
    x64, g64 = x.detach().double(), grad.double()
    rows_x, rows_g = x64.reshape(-1, 24), g64.reshape(-1, 40)
    exact = {  # name: (float64 result, Σ|terms|, n)
        "output": (F.linear(x64, w, b), F.linear(x64.abs(), w.abs(), b.abs()), 24 + 1),
        "input grad": (g64 @ w, g64.abs() @ w.abs(), 40),
        "weight grad": (rows_g.T @ rows_x, rows_g.abs().T @ rows_x.abs(), 35),
        "bias grad": (rows_g.sum(0), rows_g.abs().sum(0), 35),
    }
    results = {
        "untiled": {"output": y, "input grad": x.grad, "weight grad": linear.weight.grad,
                    "bias grad": linear.bias.grad},
        f"{tiles} tiles": {"output": y2, "input grad": x2.grad,
                           "weight grad": torch.cat([t.weight.grad for t in tiled.tiles]),
                           "bias grad": torch.cat([t.bias.grad for t in tiled.tiles])},
    }
    for form, tensors in results.items():
        for name, value in tensors.items():
            assert_within_rounding(value.detach(), *exact[name], f"{form} {name}")


def test_bad_tiling_is_named():
    with pytest.raises(ValueError, match=r"tiles=50 is invalid: expected 1 <= tiles <= out_features \(40\)"):
        TiledLinear(8, 40, 50)
    with pytest.raises(ValueError, match=r"pattern 'blocks\.\*\.mlp\.fc9' matches no nn.Linear"):
        apply_tiling(nn.Sequential(nn.Linear(2, 2)), {"blocks.*.mlp.fc9": 2})


class Wide(nn.Module):
    """One large linear (256 → 4096) between two small ones: the operator that sets MSWM."""

    def __init__(self, tiles: int):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.big, self.out = nn.Linear(16, 256), nn.Linear(256, 4096), nn.Linear(4096, 1)
        if tiles > 1:
            apply_tiling(self, {"big": tiles})

    def forward(self, x):
        return self.out(torch.relu(self.big(self.inp(x)))).pow(2).mean()


def _peak_gathered(rank, world, tiles):
    cfg = make_config(zero={"stage": 3, "prefetch_mb": 0.0}, batch={"micro_batch_size": 4})
    model = Wide(tiles)
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))  # tiles become units by default
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x))
    engine.step()
    root = engine.flat.units[0].full.numel() * 4  # inp, out (and big when untiled) stay in the root unit
    return engine.flat.peak_gathered_bytes, root, engine.full_state_dict()


@pytest.mark.timeout(60)
def test_stage3_gathers_one_tile_at_a_time():
    big_bytes = (256 * 4096 + 4096) * 4
    results = {t: run_distributed(_peak_gathered, 2, t, timeout=50)[0] for t in (1, 4, 16)}
    untiled_peak, _, _ = results[1]
    assert untiled_peak >= big_bytes
    for tiles in (4, 16):
        peak, root, _ = results[tiles]
        tile_part = peak - root  # what is gathered beyond the small root unit
        assert tile_part <= big_bytes / tiles * 1.1, f"{tiles} tiles: {tile_part} B gathered at once"
    # Tiled or not, the step is the single-process step on both ranks' inputs (float64 oracle).
    cfg = make_config(zero={"stage": 3, "prefetch_mb": 0.0}, batch={"micro_batch_size": 4})
    both_ranks = torch.cat([torch.randn(4, 16, generator=torch.Generator().manual_seed(r)) for r in range(2)])
    oracle = Oracle.run(reference_train, Wide(1), cfg, [both_ranks])
    for tiles, (_, _, params) in results.items():
        if tiles > 1:
            for kind in ("weight", "bias"):
                params[f"big.{kind}"] = torch.cat([params.pop(f"big.tiles.{i}.{kind}") for i in range(tiles)])
        oracle.check(None, params, f"one ZeRO-3 step with {tiles} tiles")
