"""Memory-centric tiling: the tiled layer equals the untiled one, and under ZeRO-3 the
parameter working memory of a large linear falls in proportion to the tile count."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tiertrain
from reference import make_config
from tiertrain.testing import run_distributed
from tiertrain.tiling import TiledLinear, apply_tiling


@pytest.mark.parametrize("tiles", [1, 3, 8])
def test_tiled_linear_equals_linear_in_output_and_gradients(tiles):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    tiled = TiledLinear.from_linear(linear, tiles)
    x = torch.randn(5, 7, 24, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = linear(x), tiled(x2)
    torch.testing.assert_close(y2, y, rtol=1e-6, atol=1e-7)
    grad = torch.randn_like(y)
    y.backward(grad)
    y2.backward(grad)
    # Gradients are sums (over tiles for the input, over 35 rows for weight and bias) whose
    # terms are the same but whose kernels associate them differently on a column slice:
    # they agree to the fp32 rounding of such sums (values here are O(1)), not bit for bit.
    sums = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x2.grad, x.grad, **sums)
    torch.testing.assert_close(torch.cat([t.weight.grad for t in tiled.tiles]), linear.weight.grad, **sums)
    torch.testing.assert_close(torch.cat([t.bias.grad for t in tiled.tiles]), linear.bias.grad, **sums)


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
    one, sixteen = results[1][2], results[16][2]
    w16 = torch.cat([sixteen[f"big.tiles.{i}.weight"] for i in range(16)])
    torch.testing.assert_close(w16, one["big.weight"], rtol=1e-5, atol=1e-7)
