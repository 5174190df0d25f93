"""partitioned_init builds exactly the model an ordinary construction builds (ZeRO-Infinity §5.3
"ease of use"), also for models that initialise their weights from the top after
construction (Hugging Face's post_init), with about one module whole at a time, and says so
clearly where it cannot be exact (from_pretrained, a Parameter made from a shard's data)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import tiertrain
from reference import make_config, make_model
from tiertrain.testing import run_distributed
from tiertrain.zero.construct import (PartitionedInitError, full_shape, gather_partitioned, is_partitioned,
                                      partitioned_init)

transformers = pytest.importorskip("transformers")
from test_zero import _hf_family, _llama, _t5  # noqa: E402  (the small configs the stage-3 tests train)

WORLD = 2


# -- models -----------------------------------------------------------------------------------

class LoRALinear(nn.Module):
    """A hand-made low-rank adapter around a frozen linear (peft's layout): the adapter is
    attached first and initialised afterwards, and reads the base weight's shape, as peft does."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base = base
        out_features, in_features = base.weight.shape
        self.lora_A = nn.Linear(in_features, r, bias=False)
        self.lora_B = nn.Linear(r, out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # 2-D only: a shard would fail
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def _lora_llama() -> nn.Module:
    """Llama frozen with requires_grad_(False), then trainable adapters on q and v."""
    model = _llama()
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model


class TopInit(nn.Module):
    """Initialises from the top at the end of __init__ (self.apply), with the patterns models
    use: .data in place, an alias of .data written afterwards, a row of a padded embedding,
    shape-dependent nn.init functions, and a parameter of the root itself."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16, padding_idx=3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16))
                                    for _ in range(3))
        self.norm = nn.LayerNorm(16)
        self.scale = nn.Parameter(torch.empty(16))
        self.apply(self._init)

    def _init(self, module: nn.Module) -> None:
        if isinstance(module, nn.Embedding):
            w = module.weight.data
            w.normal_(0.0, 0.02)
            w[module.padding_idx].zero_()
        elif isinstance(module, nn.Linear):
            if module.in_features < module.out_features:
                nn.init.xavier_uniform_(module.weight)
            else:
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            module.bias.data.uniform_(-0.1, 0.1)
        elif isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(1.5)
        elif module is self:
            nn.init.trunc_normal_(self.scale, std=0.5)


def _top_init() -> nn.Module:
    torch.manual_seed(0)
    return TopInit()


def _llama_from_config() -> nn.Module:
    """The path the from_pretrained error recommends: AutoModel.from_config, then load_pretrained."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _gpt() -> nn.Module:
    return make_model(n_layers=3)


def _gpt_untied() -> nn.Module:
    return make_model(n_layers=2, tie_embeddings=False, bias=True)


BUILDERS = {"gpt": _gpt, "gpt_untied": _gpt_untied, "top_init": _top_init, "llama": _llama, "t5": _t5,
            "bart": lambda: _hf_family("bart"), "bert": lambda: _hf_family("bert"),
            "gpt2": lambda: _hf_family("gpt2"), "lora_llama": _lora_llama,
            "llama_from_config": _llama_from_config}
"""Each seeds torch with 0 itself."""


def _largest_module(model: nn.Module) -> int:
    """Elements of the largest single module's own parameters (a tied one counted in each)."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


# -- per rank ---------------------------------------------------------------------------------

def _build_and_compare(rank, world, names):
    """Per model: parameters whose gathered value differs from an ordinary build's, the
    elements each parameter holds vs ceil(numel/world), and the context's peak."""
    topology = tiertrain.Topology.build()
    out = {}
    for name in names:
        with partitioned_init(topology) as ctx:
            model = BUILDERS[name]()
        named = dict(model.named_parameters())
        assert all(is_partitioned(p) for p in named.values()), f"{name}: a parameter was left whole"
        held = {n: (p.numel(), -(-full_shape(p).numel() // world)) for n, p in named.items()}
        gathered = {n: gather_partitioned(p, ctx.comm) for n, p in named.items()}
        frozen = {n for n, p in named.items() if not p.requires_grad}
        reference = BUILDERS[name]()
        ref = dict(reference.named_parameters())
        assert gathered.keys() == ref.keys(), f"{name}: {sorted(gathered.keys() ^ ref.keys())}"
        differ = sorted(n for n in ref
                        if gathered[n].shape != ref[n].shape or not torch.equal(gathered[n], ref[n]))
        ties_kept = [(a, b) for a, b in _ties(reference) if _param(model, a) is not _param(model, b)]
        out[name] = dict(differ=differ, held=held, peak=ctx.peak_whole_numel, gathers=ctx.materialisations,
                         largest=_largest_module(reference), total=sum(p.numel() for p in ref.values()),
                         frozen_ok=frozen == {n for n, p in ref.items() if not p.requires_grad},
                         ties_broken=ties_kept)
    return out


def _param(model: nn.Module, name: str) -> nn.Parameter:
    return model.get_parameter(name)


def _ties(model: nn.Module) -> list[tuple[str, str]]:
    """Pairs of names under which one Parameter object is registered."""
    first: dict[int, str] = {}
    pairs = []
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((first[id(p)], n))
        else:
            first.setdefault(id(p), n)
    return pairs


def _stage3_llama(rank, world):
    """Built under partitioned_init and wrapped at stage 3: full_state_dict() is the model."""
    topology = tiertrain.Topology.build()
    with partitioned_init(topology):
        model = _llama()
    engine = tiertrain.wrap(model, make_config(zero={"stage": 3}), topology)
    full = engine.full_state_dict()
    reference = dict(_llama().named_parameters())
    return sorted(n for n in reference if not torch.equal(full[n], reference[n].detach()))


def _errors(rank, world, pretrained_dir):
    """The constructions that cannot be exact, each as the message it raises."""
    topology = tiertrain.Topology.build()
    messages = {}
    try:
        with partitioned_init(topology):
            transformers.LlamaForCausalLM.from_pretrained(pretrained_dir)
    except PartitionedInitError as e:
        messages["from_pretrained"] = str(e)

    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Parameter(self.a.weight)  # a second Parameter over a's (sharded) storage

    try:
        with partitioned_init(topology):
            Aliased()
    except PartitionedInitError as e:
        messages["aliased"] = str(e)
    try:
        with partitioned_init(topology):
            with partitioned_init(topology):
                pass
    except PartitionedInitError as e:
        messages["nested"] = str(e)
    # A failed construction leaves no hook or mode behind: an ordinary build still works.
    torch.manual_seed(0)
    messages["after"] = nn.Linear(3, 5).weight.shape == (5, 3)
    return messages


# -- tests ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built():
    """Every model built once on 2 ranks (one launch serves both tests below)."""
    return run_distributed(_build_and_compare, WORLD, list(BUILDERS), timeout=220)


@pytest.mark.timeout(240)
def test_partitioned_construction_equals_ordinary_construction(built):
    """Our GPT (tied and untied), a model initialising from the top with self.apply, Llama
    (GQA, also through AutoModel.from_config), T5, BART, BERT, GPT-2 and a frozen Llama with
    LoRA-style adapters: every parameter gathered equals, bit for bit, the same code's build
    without the context under the same seed; ties and frozen flags survive."""
    for rank, per_model in enumerate(built):
        for name, r in per_model.items():
            assert not r["differ"], \
                f"rank {rank} {name}: gathered parameters differ from an ordinary build: {r['differ']}"
            assert not r["ties_broken"], f"rank {rank} {name}: ties lost: {r['ties_broken']}"
            assert r["frozen_ok"], f"rank {rank} {name}: requires_grad flags changed"


@pytest.mark.timeout(240)
def test_partitioned_construction_holds_half_and_one_module_at_a_time(built):
    """Each rank holds ceil(numel/2) elements per parameter after construction, and the most
    elements ever whole at once is at most the largest module, far below the whole model."""
    for per_model in built:
        for name, r in per_model.items():
            wrong = {n: h for n, h in r["held"].items() if h[0] != h[1]}
            assert not wrong, f"{name}: parameters holding other than ceil(numel/2) elements: {wrong}"
            held = sum(h[0] for h in r["held"].values())
            assert held <= r["total"] / WORLD + len(r["held"]), f"{name}: holds {held} of {r['total']}"
            assert r["peak"] <= r["largest"], \
                f"{name}: {r['peak']} elements whole at once, more than its largest module ({r['largest']})"
            assert r["peak"] < r["total"] / 2, f"{name}: peak {r['peak']} is not far below the model {r['total']}"
            if name not in ("gpt", "gpt_untied"):  # our GPT never initialises from the top
                assert r["gathers"] > 0, f"{name}: nothing was materialised, so nothing was tested"


@pytest.mark.timeout(240)
def test_stage3_wrap_of_partitioned_llama_and_clear_errors(tmp_path):
    """A Llama built partitioned then wrapped at stage 3 gives full_state_dict() equal to an
    ordinary build; from_pretrained, nn.Parameter(shard) and nesting raise clear errors."""
    _llama().save_pretrained(tmp_path)
    assert run_distributed(_stage3_llama, WORLD, timeout=120) == [[], []]
    for messages in run_distributed(_errors, WORLD, str(tmp_path), timeout=120):
        assert "tiertrain.load_pretrained" in messages.get("from_pretrained", ""), messages
        assert "Tie the Parameter object itself" in messages.get("aliased", ""), messages
        assert "already active" in messages.get("nested", ""), messages
        assert messages["after"]
