"""The optimizer instance given to ``wrap(optimizer=)`` stays the user's optimizer, as under
DeepSpeed or FSDP: its param_groups show the engine's hyper-parameters, and what the loop sets
on them is what the next update uses.

The engine steps its own copy over the flat shards, never the instance, so a rate set by hand
(``group["lr"] = lr``, PyTorch's ImageNet example and nanoGPT) used to change nothing and the
instance went on showing the rate of wrap(). Now the loop's rates train as torch's would, on
every form of the step, also when set after the backward an overlapped update began in (that
update is redone). With ``wrap(lr_scheduler=)`` the instance shows that scheduler's rates and a
change on it is refused; a group added after wrap() is refused by name instead of never
training, and so are the instance's step() and state_dict(). A parameter frozen at wrap() is
unfrozen during training by raising its group's rate from 0 (tests/test_user_loop.py: unfreezing
it is refused).
"""
from __future__ import annotations

import functools

import pytest
import torch

import tiertrain
from reference import Oracle, global_batches, make_config, make_model, reference_train
from tiertrain.config import ConfigError
from tiertrain.engine_contract import default_loss

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

STEPS, MICRO = 4, 2
RATES = [(1e-2, 3e-3), (5e-3, 3e-3), (5e-3, 1e-3), (1e-3, 1e-3)]
"""Each update's rate for the two groups, as a loop sets them by hand."""
ONE_RATE = [(a, a) for a, _ in RATES]
"""The same for the NVMe tier, which streams every group at one rate."""
SET_AFTER_BACKWARD = (1, 3)
"""The updates whose rates the loop sets between engine.backward() and engine.step() (the
others: before the forward)."""

FORMS = {
    "stage 0": {"stage": 0},
    "stage 3, parameters and optimizer on CPU": {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"},
    "stage 2, optimizer on CPU": {"stage": 2, "offload_optimizer": "cpu"},
    "stage 2, NVMe step overlapped with backward": {"stage": 2, "offload_optimizer": "nvme"},
    "stage 2, delayed update": {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True},
}


def adamw(model) -> torch.optim.AdamW:
    """The user's AdamW, two groups (eps 1e-3: tests/test_engine.py says why)."""
    return torch.optim.AdamW(two_groups(model), lr=1e-2, eps=1e-3)


def two_groups(model) -> list[dict]:
    """Matrices decayed, the rest not: the Hugging Face split, on the model's own tensors."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def _config(zero: dict, tmp_path, **optimizer):
    zero = {**zero, "nvme_path": str(tmp_path)} if zero.get("offload_optimizer") == "nvme" else zero
    return make_config(zero=zero, batch={"micro_batch_size": MICRO}, optimizer={"grad_clip": 0.0, **optimizer})


def _set(optimizer, rates) -> None:
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr


class _ByHand:
    """The reference's side of the loop: the same rates set on torch's optimizer before each
    update (reference_train steps it after each)."""

    def __init__(self, optimizer, rates=RATES):
        self.optimizer, self.update, self.rates = optimizer, 0, rates
        _set(optimizer, rates[0])

    def step(self):
        self.update += 1
        if self.update < len(self.rates):
            _set(self.optimizer, self.rates[self.update])


def _rates(zero: dict) -> list[tuple[float, float]]:
    return ONE_RATE if zero.get("offload_optimizer") == "nvme" else RATES


def _train_setting_rates_by_hand(zero: dict, tmp_path):
    model = make_model()
    optimizer = adamw(model)
    config = _config(zero, tmp_path)
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), optimizer=optimizer)
    losses, shown = [], []
    rates = _rates(zero)
    for update, batch in enumerate(global_batches(STEPS, MICRO)):
        if update not in SET_AFTER_BACKWARD:
            _set(optimizer, rates[update])
        loss = engine(batch)
        engine.backward(loss)
        if update in SET_AFTER_BACKWARD:
            _set(optimizer, rates[update])
        assert engine.step()
        losses.append(loss.item())
        shown.append(tuple(g["lr"] for g in optimizer.param_groups))
    params = {n: p.float() for n, p in engine.full_state_dict().items()}
    return engine, losses, params, shown


@pytest.mark.parametrize("form", [f for f in FORMS if f != "stage 2, delayed update"])
def test_rates_set_by_hand_on_the_instance_train_like_torch(form, tmp_path):
    engine, losses, params, shown = _train_setting_rates_by_hand(FORMS[form], tmp_path)
    form_built = type(engine.update).__name__
    engine.close()
    reference = Oracle.run(reference_train, make_model(), _config(FORMS[form], tmp_path),
                           global_batches(STEPS, MICRO), build_optimizer=adamw,
                           lr_scheduler=functools.partial(_ByHand, rates=_rates(FORMS[form])))
    reference.check(losses, params, form)
    assert shown == _rates(FORMS[form]), "the instance shows the rates each update used"
    if "overlapped" in form:  # (its updates 1 and 3 began in backward at the old rates: redone)
        assert form_built == "OverlappedNVMeUpdate", form_built


def _delayed_reference(model, config, batches):
    """Plain PyTorch, one update behind (ZeRO-Offload §4, warmup 0): step t's gradients are
    applied after step t+1's backward, at the rates the loop set before step t."""
    params = list(model.parameters())
    optimizer = adamw(model)
    held = None

    def apply(grads, rates):
        _set(optimizer, rates)
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()

    losses = []
    for update, batch in enumerate(batches):
        loss = default_loss(model, batch)
        loss.backward()
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        if held is not None:
            apply(*held)
        held = grads, RATES[update]
        losses.append(loss.item())
    apply(*held)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_delayed_update_steps_at_the_rates_set_before_its_step(tmp_path):
    """One update behind: update t runs during step t+1's forward and backward with the rates
    the loop set before step t (also those set after its backward)."""
    zero = {**FORMS["stage 2, delayed update"], "delayed_update_warmup": 0}
    engine, losses, params, shown = _train_setting_rates_by_hand(zero, tmp_path)
    engine.close()
    assert shown == RATES
    Oracle.run(_delayed_reference, make_model(), None, global_batches(STEPS, MICRO)).check(
        losses, params, "delayed update")


def test_the_instance_shows_the_engines_scheduler_and_refuses_a_change(tmp_path):
    """With lr_scheduler= the engine's scheduler sets every update's rates: the instance shows
    them (torch's StepLR sequence); a rate set on it is refused at step(), before anything
    changed, and the run then goes on exactly as one without the mistake."""
    def run(mistake: bool):
        model = make_model()
        optimizer = torch.optim.AdamW(two_groups(model), lr=1e-2)
        config = _config({"stage": 2}, tmp_path)
        engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), optimizer=optimizer,
                                lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
        shown = []
        for update, batch in enumerate(global_batches(3, MICRO)):
            engine.backward(engine(batch))
            if mistake and update == 1:
                optimizer.param_groups[1]["lr"] = 0.123
                with pytest.raises(ConfigError, match=r"param_groups\[1\]\['lr'\] of the AdamW instance given as "
                                                      r"optimizer= was changed from 0.005 to 0.123, but "
                                                      r"wrap\(lr_scheduler=\) sets every update's hyper-parameters"):
                    engine.step()
                optimizer.param_groups[1]["lr"] = 0.005
            assert engine.step()
            shown.append(optimizer.param_groups[1]["lr"])
        params = engine.full_state_dict()
        engine.close()
        return shown, params

    shown, clean = run(mistake=False)
    assert shown == [0.005, 0.0025, 0.00125]
    shown_again, params = run(mistake=True)
    assert shown_again == shown and all(torch.equal(params[n], clean[n]) for n in clean)


def test_a_group_added_to_the_instance_after_wrap_is_refused():
    model = make_model()
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW([p for n, p in named if n != "norm.bias"], lr=1e-2)
    model.norm.bias.requires_grad_(False)
    config = make_config(batch={"micro_batch_size": MICRO})
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), optimizer=optimizer)
    optimizer.add_param_group({"params": [model.norm.bias]})
    batch = global_batches(1, MICRO)[0]
    with pytest.raises(ConfigError, match=r"the param_groups of the AdamW instance given as optimizer= changed their "
                                          r"parameters after wrap\(\) \(add_param_group"):
        engine.backward(engine(batch))
    engine.close()


def test_unfreezing_by_raising_a_groups_rate_from_zero_trains_like_torch(tmp_path):
    """What the refusal above recommends: the backbone trainable from the start in a group of
    its own at lr 0 (it does not move, bit for bit), its rate raised later on the instance."""
    rates = [(0.0, 1e-2), (0.0, 1e-2), (1e-2, 1e-2), (1e-2, 1e-2)]

    def backbone_and_head(model):
        named = list(model.named_parameters())
        return [{"params": [p for n, p in named if n.startswith("blocks.0.")]},
                {"params": [p for n, p in named if not n.startswith("blocks.0.")]}]

    model = make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("blocks.0.")}
    optimizer = torch.optim.AdamW(backbone_and_head(model), lr=1e-2)
    config = _config({"stage": 3}, tmp_path)
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), optimizer=optimizer)
    losses = []
    for update, batch in enumerate(global_batches(STEPS, MICRO)):
        _set(optimizer, rates[update])
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if update == 1:
            held = engine.full_state_dict()
            assert all(torch.equal(held[n], initial[n]) for n in initial), "at lr 0 the backbone does not move"
    params = engine.full_state_dict()
    engine.close()
    assert not torch.equal(params["blocks.0.mlp.fc1.weight"], initial["blocks.0.mlp.fc1.weight"])
    Oracle.run(reference_train, make_model(), config, global_batches(STEPS, MICRO),
               build_optimizer=lambda m: torch.optim.AdamW(backbone_and_head(m)),
               lr_scheduler=functools.partial(_ByHand, rates=rates)).check(losses, params, "unfrozen at update 2")


def test_an_nvme_step_in_place_keeps_the_rates_it_began_with_and_says_so(tmp_path):
    """zero.nvme_in_place has no pre-step state to redo an update from: a rate set after the
    backward its update began in applies from the next update, with a warning."""
    zero = {**FORMS["stage 2, NVMe step overlapped with backward"], "nvme_in_place": True}
    with pytest.warns(RuntimeWarning, match=r"apply from the next update: this one began during backward, in place "
                                            r"on NVMe \(zero.nvme_in_place\)"):
        engine, losses, params, shown = _train_setting_rates_by_hand(zero, tmp_path)
    engine.close()
    assert shown == ONE_RATE
    used = [ONE_RATE[u - 1] if u in SET_AFTER_BACKWARD else ONE_RATE[u] for u in range(STEPS)]
    Oracle.run(reference_train, make_model(), _config(zero, tmp_path), global_batches(STEPS, MICRO),
               build_optimizer=adamw, lr_scheduler=functools.partial(_ByHand, rates=used)).check(
        losses, params, "in place")


def test_a_scheduler_on_the_instance_that_needs_a_metric_sets_the_engines_rate():
    """ReduceLROnPlateau is stepped with the loop's metric, so it cannot be an lr_scheduler=
    factory: built on the instance after wrap(), its cuts are the engine's rates."""
    model = make_model()
    optimizer = adamw(model)
    config = make_config(batch={"micro_batch_size": MICRO})
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), optimizer=optimizer)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    rates = []
    for batch in global_batches(3, MICRO):
        engine.backward(engine(batch))
        engine.step()
        plateau.step(1.0)  # (the first is its best; no improvement after it: halved)
        rates.append(engine.learning_rate())
    engine.close()
    assert rates == [1e-2, 5e-3, 2.5e-3]


def test_the_instance_refuses_what_only_the_engine_can_do_until_close():
    """step() where engine.step() belongs, and state_dict()/load_state_dict(), whose file would
    hold no moments; close() gives the instance back as it was, a scheduler's hook included."""
    model = make_model()
    optimizer = adamw(model)
    scheduler_hook = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1) and optimizer.step
    config = make_config(batch={"micro_batch_size": MICRO})
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), optimizer=optimizer,
                            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1))
    engine.backward(engine(global_batches(1, MICRO)[0]))
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) was called on the instance given to wrap\(optimizer=\): "
                                           r"the engine never steps it .* call engine.step\(\)"):
        optimizer.step()
    with pytest.raises(RuntimeError, match=r"would hold none of the optimizer's state .* save with "
                                           r"engine.save_checkpoint\(dir\)"):
        optimizer.state_dict()
    with pytest.raises(RuntimeError, match=r"resume with engine.load_checkpoint\(dir\)"):
        optimizer.load_state_dict({})
    assert engine.step()
    optimizer.zero_grad()  # (after the step: harmless; between backward and step refused, test_held_gradients.py)
    engine.close()
    assert optimizer.step == scheduler_hook and len(optimizer.state_dict()["param_groups"]) == 2


@pytest.mark.parametrize("stage", [0, 3])
def test_an_optimizer_not_given_to_wrap_refuses_to_step_the_engines_parameters(stage):
    """An optimizer built on model.parameters() and never given to wrap() (or built after it)
    saw no gradient and stepped nothing, without a word: its rate, scheduler or GradScaler
    changed nothing. Its step() now raises, naming the parameters; an optimizer of other
    parameters steps as always, and once the engine is closed this one does too."""
    model = make_model()
    stray = adamw(model)
    other = torch.nn.Linear(2, 2)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    config = make_config(zero={"stage": stage}, batch={"micro_batch_size": MICRO})
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
    engine.backward(engine(global_batches(1, MICRO)[0]))
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) steps parameters that tiertrain.wrap\(\) holds "
                                           r"\('embed.weight', .* on an optimizer not given to wrap\(\): .* pass this "
                                           r"AdamW as wrap\(optimizer=...\)"):
        stray.step()
    other(torch.ones(2)).sum().backward()
    before = other.weight.detach().clone()
    other_optimizer.step()
    assert not torch.equal(other.weight, before)
    assert engine.step()
    engine.close()
    model(**global_batches(1, MICRO)[0]).backward()
    stray.step()  # (a plain model again)
