"""The pieces that rebuild a sharded model on new shapes (comera.train.reshard), in one process: a meta
template keeps ties and trainability and holds no storage, a fresh copy allocates it, and the optimizer state
moves by parameter name with every param-group entry, into an optimizer whose positions differ."""

import pytest
import torch
from tiny import loss_fn, make_data, make_model
from torch import nn

from comera.methods.comera.objective import CoMERAObjective
from comera.train.reshard import (
    fresh_copy,
    load_whole_optimizer_state,
    meta_template,
    whole_optimizer_state,
)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Linear(3, 3)
        self.frozen.weight.requires_grad_(False)
        self.register_buffer("scale", torch.full((3,), 2.0))


def test_meta_template_holds_no_storage_and_keeps_ties_trainability_and_buffers():
    model = Tied()
    template = meta_template(model)
    assert all(param.is_meta for param in template.parameters())
    assert template.head.weight is template.embed.weight
    assert not template.frozen.weight.requires_grad and template.frozen.bias.requires_grad
    torch.testing.assert_close(template.scale, model.scale)
    assert not model.embed.weight.is_meta, "the model itself is untouched"
    fresh = fresh_copy(template, torch.device("cpu"))
    assert not any(param.is_meta for param in fresh.parameters())
    assert fresh.head.weight is fresh.embed.weight and fresh.embed.weight is not model.embed.weight
    assert [name for name, _ in fresh.named_parameters()] == [name for name, _ in model.named_parameters()]
    assert not fresh.frozen.weight.requires_grad
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh.head.weight, model.head.weight)
    assert fresh_copy(template, torch.device("cpu")).embed.weight is not fresh.embed.weight


def trained_comera(steps: int = 3):
    model = make_model(dropout=0.0)
    objective = CoMERAObjective(model)
    optimizer = torch.optim.AdamW(objective.param_groups(lr=1e-2, weight_decay=0.1))
    data = make_data()
    for step in range(steps):
        inputs, labels = data[8 * step : 8 * (step + 1)]
        optimizer.zero_grad()
        objective.loss(loss_fn(model, (inputs, labels))).backward()
        optimizer.step()
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"] * 3  # an entry the schedule adds, which must travel too
    return model, objective, optimizer


def test_the_optimizer_state_moves_by_name_with_every_group_entry():
    model, objective, optimizer = trained_comera()
    named = whole_optimizer_state(model, optimizer)
    assert set(named["state"]) == {name for name, p in model.named_parameters() if p in optimizer.state}
    fresh = fresh_copy(meta_template(model), torch.device("cpu"))
    fresh.load_state_dict(model.state_dict())
    # the same groups with their parameters in reverse order: positions differ, names do not
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(reversed(list(members)))}
        for group, members in zip(
            optimizer.param_groups,
            [[dict(fresh.named_parameters())[n] for n in g["params"]] for g in named["param_groups"]],
            strict=True,
        )
    ]
    target = torch.optim.AdamW(groups)
    load_whole_optimizer_state(fresh, target, named)
    by_name = dict(fresh.named_parameters())
    for name, values in named["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(target.state[by_name[name]][key], value, msg=f"{name}.{key}")
    for loaded, saved in zip(target.param_groups, optimizer.param_groups, strict=True):
        assert {k: v for k, v in loaded.items() if k != "params"} == {
            k: v for k, v in saved.items() if k != "params"
        }
    # one more step of each gives the same parameters (to rounding: each layer picks its contraction order)
    data = make_data()
    for net, opt in ((model, optimizer), (fresh, target)):
        opt.zero_grad()
        loss_fn(net, data[:8]).backward()
        opt.step()
    for (name, param), other in zip(model.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(
            other, param, rtol=1e-6, atol=1e-7, msg=name
        )  # contraction orders may differ


def test_a_group_of_other_parameters_is_refused():
    model, objective, optimizer = trained_comera(1)
    named = whole_optimizer_state(model, optimizer)
    named["param_groups"][0]["params"] = named["param_groups"][0]["params"][:-1]
    target = torch.optim.AdamW(objective.param_groups(lr=1e-2, weight_decay=0))
    with pytest.raises(ValueError, match=r"^param group 0 holds \['0.cores.0'"):
        load_whole_optimizer_state(model, target, named)
    named["param_groups"] = named["param_groups"][:2]
    with pytest.raises(ValueError, match="the saved optimizer state has 2 param groups, the optimizer 3"):
        load_whole_optimizer_state(model, target, named)
