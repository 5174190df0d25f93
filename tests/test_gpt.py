"""Specification of tiertrain.models.gpt: shapes, loss, parameter count, init rules."""

import copy
import math

import pytest
import torch

from reference import check_tensors
from tiertrain.models import GPT, GPTConfig, gpt_tiny
from tiertrain.models.gpt import PRESETS

# A config small enough that each test builds and runs in milliseconds.
SMALL = dict(n_layers=2, hidden=32, n_heads=4, seq_len=16)


def build(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SMALL, **overrides}))


def test_logits_shape_and_short_sequences():
    model = build()
    ids = torch.randint(0, 256, (3, 16))
    assert model(ids).shape == (3, 16, 256)
    assert model(ids[:, :5]).shape == (3, 5, 256)


def test_sequence_longer_than_seq_len_is_rejected():
    with pytest.raises(ValueError, match="seq_len=16"):
        build()(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("tie", [True, False])
def test_loss_at_init_is_near_uniform_and_backward_reaches_every_parameter(tie):
    torch.manual_seed(1)
    model = GPT(GPTConfig(tie_embeddings=tie))  # the default "tiny" shape
    ids, labels = torch.randint(0, 256, (2, 2, 128))
    loss = model(ids, labels)
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.3
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_loss_is_mean_cross_entropy_of_logits():
    model = build()
    ids, labels = torch.randint(0, 256, (2, 2, 16))
    logits = model(ids)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1))
    assert torch.equal(model(ids, labels), expected)  # the same kernels on the same logits


def test_forward_is_causal():
    model = build().eval()
    ids = torch.randint(0, 256, (1, 16))
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    # Changing later tokens may move the first 10 outputs by rounding only (the masked terms
    # still enter the kernels' sums as zeros): bounded by the fp32 forward's own distance to a
    # float64 forward (tests/reference.py).
    ref32, ref64 = model(ids)[:, :10], copy.deepcopy(model).double()(ids)[:, :10]
    check_tensors({"prefix": model(changed)[:, :10]}, {"prefix": ref32}, {"prefix": ref64}, "causal prefix")


@pytest.mark.parametrize("tie", [True, False])
def test_same_seed_gives_identical_weights(tie):
    a, b = build(seed=7, tie_embeddings=tie), build(seed=7, tie_embeddings=tie)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert not torch.equal(sa["embed.weight"], build(seed=8, tie_embeddings=tie).state_dict()["embed.weight"])


def test_tied_model_draws_a_prefix_of_the_untied_models_random_numbers():
    tied, untied = build(seed=3), build(seed=3, tie_embeddings=False)
    assert tied.head.weight is tied.embed.weight
    assert untied.head.weight is not untied.embed.weight
    st, su = tied.state_dict(), untied.state_dict()
    for key in st:
        if key != "head.weight":
            assert torch.equal(st[key], su[key]), key
    # ...and the untied head is exactly the next draw after the tied model's last one.
    torch.manual_seed(3)
    GPT(GPTConfig(**SMALL))
    next_draw = torch.nn.init.normal_(torch.empty(256, 32), std=0.02)
    assert torch.equal(su["head.weight"], next_draw)


def test_parameter_count_matches_analytic_count():
    for tie in (True, False):
        for name in PRESETS:
            cfg = GPTConfig.preset(name, tie_embeddings=tie)
            if name != "bench":  # bench is ~40M parameters: counted analytically only
                model = GPT(cfg)
                assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    assert GPTConfig.preset("tiny").num_parameters() == 842_496
    assert 2e6 < GPTConfig.preset("small").num_parameters() < 1e7
    assert 30e6 < GPTConfig.preset("bench").num_parameters() < 50e6


def test_initialisation_follows_gpt2():
    model = build(seed=0, n_layers=4, hidden=64, n_heads=4, init_std=0.05)
    std = 0.05
    resid_std = std / math.sqrt(2 * 4)
    blk = model.blocks[0]
    assert blk.attn.qkv.weight.std().item() == pytest.approx(std, rel=0.1)
    assert blk.mlp.fc1.weight.std().item() == pytest.approx(std, rel=0.1)
    assert blk.attn.proj.weight.std().item() == pytest.approx(resid_std, rel=0.1)
    assert blk.mlp.fc2.weight.std().item() == pytest.approx(resid_std, rel=0.1)
    assert model.embed.weight.std().item() == pytest.approx(std, rel=0.1)
    assert model.pos_embed.weight.std().item() == pytest.approx(std, rel=0.1)
    for lin in (blk.attn.qkv, blk.attn.proj, blk.mlp.fc1, blk.mlp.fc2):
        assert torch.count_nonzero(lin.bias) == 0
    for ln in (blk.ln1, blk.ln2, model.norm):
        assert torch.all(ln.weight == 1) and torch.all(ln.bias == 0)


def test_each_submodule_initialises_itself_in_construction_order():
    # Building the pieces by hand, in order, from the same seed reproduces the model:
    # no step after a submodule's own __init__ touches its parameters.
    from tiertrain.models.gpt import Block

    cfg = GPTConfig(**SMALL)
    model = build(seed=5)
    torch.manual_seed(5)
    torch.nn.init.normal_(torch.empty(256, 32), std=0.02)  # embed
    torch.nn.init.normal_(torch.empty(16, 32), std=0.02)  # pos_embed
    block0 = Block(cfg)
    assert all(torch.equal(a, b) for a, b in zip(block0.parameters(), model.blocks[0].parameters()))


def test_module_structure_names():
    model = build()
    names = {n for n, _ in model.named_modules()}
    for expected in ("embed", "pos_embed", "blocks.0.ln1", "blocks.0.attn.qkv", "blocks.0.attn.proj",
                     "blocks.0.ln2", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2", "norm", "head"):
        assert expected in names
    assert model.blocks[0].attn.qkv.weight.shape == (96, 32)
    assert model.blocks[0].mlp.fc1.weight.shape == (128, 32)
    assert model.head.bias is None


def test_attention_runs_on_a_head_shard():
    # Megatron §2.3: a column shard of qkv (whole heads) and row shard of proj compute
    # a partial output; summing the shards' outputs gives the full attention output.
    model = build(dropout=0.0)
    attn = model.blocks[0].attn
    x = torch.randn(2, 16, 32)
    full = attn(x)
    parts = []
    for rank in range(2):
        shard = build().blocks[0].attn
        rows = slice(rank * 48, (rank + 1) * 48)
        cols = slice(rank * 16, (rank + 1) * 16)
        shard.qkv = torch.nn.Linear(32, 48)
        shard.qkv.weight.data, shard.qkv.bias.data = attn.qkv.weight[rows].clone(), attn.qkv.bias[rows].clone()
        shard.proj = torch.nn.Linear(16, 32)
        shard.proj.weight.data = attn.proj.weight[:, cols].clone()
        shard.proj.bias.data = attn.proj.bias.clone() if rank == 0 else torch.zeros(32)
        parts.append(shard(x))
    full64 = copy.deepcopy(attn).double()(x.double())
    check_tensors({"attn": parts[0] + parts[1]}, {"attn": full}, {"attn": full64}, "two head shards")


def test_dropout_layers_exist_and_respect_config():
    model = build(dropout=0.1)
    rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == {0.1}


def test_gpt_tiny_and_presets():
    assert gpt_tiny().config == GPTConfig()
    assert GPTConfig.preset("small", n_layers=2).n_layers == 2
    with pytest.raises(ValueError, match="'huge'.*bench.*small.*tiny"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="layers"):
        GPTConfig.preset("tiny", layers=3)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("hidden", 130, r"hidden=130.*divisible by n_heads=4"),
        ("n_layers", 0, r"n_layers=0.*positive int"),
        ("vocab_size", 2.5, r"vocab_size=2.5.*positive int"),
        ("seq_len", True, r"seq_len=True.*positive int"),
        ("dropout", 1.0, r"dropout=1.0.*\[0, 1\)"),
        ("dropout", -0.1, r"dropout=-0.1"),
        ("layernorm_eps", 0.0, r"layernorm_eps=0.0.*> 0"),
        ("init_std", -1.0, r"init_std=-1.0"),
        ("tie_embeddings", 1, r"tie_embeddings=1.*bool"),
    ],
)
def test_validate_names_field_and_value(field, value, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{field: value}).validate()
    with pytest.raises(ValueError, match=match):
        GPT(GPTConfig(**{field: value}))
