"""``CoMERATrainer``: a tiny tensorized ``LlamaForCausalLM`` trained by ``transformers.Trainer`` with CoMERA's
objective, groups, stages and prune points; saved and loaded back; compared with ``comera.train.Trainer``."""

import copy
import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

import torch  # noqa: E402
import transformers  # noqa: E402
from hf_tiny import BATCH, RepeatingTokens, arguments, llama_config, lm_loss, tiny_llama  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import comera  # noqa: E402
from comera.integrations.hf_stages import early_steps_of  # noqa: E402
from comera.integrations.hf_trainer import CoMERATrainer  # noqa: E402
from comera.methods.comera import CoMERAObjective, CoMERASettings  # noqa: E402
from comera.rank.size import gated_trains  # noqa: E402
from comera.train import TrainConfig, Trainer  # noqa: E402

SETTINGS = CoMERASettings(lr_cores=1e-2, lr_gates=1e-2, recovery=0.6)
EARLY, STEPS = 16, 40  # 32 sequences in batches of 4: an epoch is 8 steps; the late stage trims at step 26


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The 40-step run (early 16, late 24) with a checkpoint at its last step."""
    out = tmp_path_factory.mktemp("hf-run")
    args = arguments(out, max_steps=STEPS, save_strategy="steps", save_steps=STEPS)
    trainer = CoMERATrainer(
        tiny_llama(), args, train_dataset=RepeatingTokens(), settings=SETTINGS, early=EARLY
    )
    trainer.train()
    return trainer


def events(trainer, name):
    return [event for event in trainer.comera_callback.events if event["event"] == name]


def train_logs(trainer):
    return [record for record in trainer.state.log_history if "comera_task_loss" in record]


def same_details(event, reference) -> bool:
    """The same keys, floats equal to 1e-4, everything else (steps, sizes, ranks, names) exactly."""
    return event.keys() == reference.keys() and all(
        event[key] == (pytest.approx(value, rel=1e-4) if isinstance(value, float) else value)
        for key, value in reference.items()
    )


def test_the_loss_falls_and_every_log_holds_the_size(run):
    logs = train_logs(run)
    assert [record["step"] for record in logs] == list(range(4, STEPS + 1, 4))
    assert logs[0]["comera_task_loss"] == pytest.approx(math.log(96), rel=0.1)
    assert logs[-1]["comera_task_loss"] < 0.5 * logs[0]["comera_task_loss"]
    report = comera.compression_report(run.model)
    last = run.state.log_history[-1]
    assert last["comera_size"] == run.objective.size()
    assert last["comera_params"] == report.model_params
    assert last["comera_compression"] == pytest.approx(report.tensorized_ratio)
    assert last["comera_size_ratio"] == pytest.approx(run.objective.size() / run.objective.initial_size)


def test_the_optimizer_has_comera_groups_and_rates(run):
    groups = {group["name"]: group for group in run.optimizer.optimizer.param_groups}
    assert set(groups) == {"cores", "gates", "other"}
    assert groups["cores"]["lr"] == SETTINGS.lr_cores and groups["gates"]["lr"] == SETTINGS.lr_gates
    assert groups["other"]["lr"] == run.args.learning_rate
    trains = [train for _, train in gated_trains(run.model)]
    assert {id(p) for p in groups["gates"]["params"]} == {id(g) for t in trains for g in t.gates}
    assert {id(p) for p in groups["cores"]["params"]} == {id(c) for t in trains for c in t.cores}


def test_the_late_stage_starts_at_the_requested_step(run):
    (late,) = events(run, "late_stage")
    assert late["step"] == EARLY
    assert run.objective.stage == "late"
    assert run.objective.adaptation.late_steps == STEPS - EARLY
    assert late["target_size"] == pytest.approx(SETTINGS.target_ratio * run.objective.initial_size, rel=0.05)


def test_a_prune_point_prunes_and_training_goes_on_with_matching_optimizer_state(run):
    *partial, trim = events(run, "objective")
    assert all(event["action"] == "partial_trim" for event in partial)
    assert trim["action"] == "trim" and EARLY < trim["step"] < 32
    prunes = events(run, "prune")
    assert all(earlier["step"] < trim["step"] for earlier in prunes[:-1])  # after the gradual trims
    prune = prunes[-1]
    assert (prune["step"], prune["point"]) == (32, "epoch_end")  # the late-stage epoch end after the trim
    assert all(each["stored_after"] < each["stored_before"] for each in prunes)
    ranks = {name: list(train.max_ranks) for name, train in gated_trains(run.model)}
    assert prune["layers"] and all(
        ranks[name] == layer_ranks for name, layer_ranks in prune["layers"].items()
    )
    assert run.state.global_step == STEPS
    after = [record for record in train_logs(run) if record["step"] > prune["step"]]
    assert len(after) == 2 and all(math.isfinite(record["loss"]) for record in after)
    optimizer = run.optimizer.optimizer
    optimized = [param for group in optimizer.param_groups for param in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in run.model.parameters()}
    for param in optimized:
        state = optimizer.state[param]
        assert state["exp_avg"].shape == param.shape and state["exp_avg_sq"].shape == param.shape


@pytest.mark.parametrize("folder", ["saved", "checkpoint"])
def test_the_model_saves_and_loads_into_a_fresh_base_with_the_same_logits(run, tmp_path, folder):
    if folder == "saved":
        path = tmp_path / "model"
        run.save_model(str(path))
    else:
        path = run.args.output_dir + f"/checkpoint-{STEPS}"  # transformers' checkpoint: the same files
    config = type(llama_config()).from_pretrained(path)
    loaded = comera.load_pretrained(path, base_model=LlamaForCausalLM(config))
    ids = RepeatingTokens(size=2, seed=1).ids
    run.model.eval()
    loaded.eval()
    with torch.no_grad():
        expected = run.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert comera.compression_report(loaded).model_params == comera.compression_report(run.model).model_params


def test_the_loss_the_trainer_sees_is_the_task_loss_plus_the_rank_term(tmp_path):
    """One step on a batch of identical sequences (so the batch is known), against comera's own objective
    on a copy of the same model and batch."""
    settings = CoMERASettings(gamma=0.5)
    model = tiny_llama()
    reference = copy.deepcopy(model).train()
    data = RepeatingTokens(size=BATCH, periods=1)
    batch = {key: torch.stack([data[i][key] for i in range(BATCH)]) for key in data[0]}
    task = reference(**batch).loss
    expected = CoMERAObjective(reference, settings).loss(task)
    assert expected.item() > task.item() + 0.1  # the rank term is there and not small
    args = arguments(tmp_path, max_steps=1, logging_steps=1, max_grad_norm=0.0)
    trainer = CoMERATrainer(model, args, train_dataset=data, settings=settings, early=1.0)
    trainer.train()
    (log,) = train_logs(trainer)
    assert log["loss"] == pytest.approx(expected.item(), rel=1e-6)
    assert log["comera_task_loss"] == pytest.approx(task.item(), rel=1e-6)
    trainer.model.eval()
    with torch.no_grad():  # evaluation sees the task loss alone
        assert trainer.compute_loss(trainer.model, dict(batch)).item() == pytest.approx(
            trainer.model(**batch).loss.item()
        )


@pytest.mark.parametrize(
    ("micro_batches", "accepts_loss_kwargs"), [(2, True), (2, False)], ids=["num-items", "mean-over-k"]
)
def test_accumulated_micro_batches_give_the_run_of_one_batch(
    run, tmp_path, micro_batches, accepts_loss_kwargs
):
    """The 40-step run again in ``micro_batches`` micro-batches of ``BATCH / micro_batches`` sequences per
    optimizer step: the same events with the same details, the same sizes and the same logged losses (the
    objective and the task loss) as the run of one batch of ``BATCH``. Hugging Face scales the micro-batch
    losses two ways: a model that takes ``num_items_in_batch`` divides its token sum by the step's token
    count; otherwise the Trainer divides each micro-batch's mean by the number of micro-batches."""
    args = arguments(
        tmp_path,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH // micro_batches,
        gradient_accumulation_steps=micro_batches,
    )
    trainer = CoMERATrainer(
        tiny_llama(), args, train_dataset=RepeatingTokens(), settings=SETTINGS, early=EARLY
    )
    trainer.model_accepts_loss_kwargs = accepts_loss_kwargs
    trainer.train()
    assert trainer.state.global_step == STEPS
    ours, theirs = trainer.comera_callback.events, run.comera_callback.events
    assert [(e["step"], e["event"]) for e in ours] == [(e["step"], e["event"]) for e in theirs]
    for mine, reference in zip(ours, theirs):
        assert same_details(mine, reference)
    assert trainer.objective.size() == run.objective.size()
    for key in ("loss", "comera_task_loss", "comera_size"):
        assert [r[key] for r in train_logs(trainer)] == pytest.approx(
            [r[key] for r in train_logs(run)], rel=1e-4
        )


def test_model_init_trains_a_fresh_model_with_its_own_objective_at_every_train(tmp_path):
    """Two ``train()`` calls of a trainer built from ``model_init``, against a run of the model given: each
    call trains a fresh model, with an objective and a schedule bound to it, to the same events, size and
    weights."""
    settings = CoMERASettings(lr_cores=1e-2, lr_gates=1e-2, recovery=0.5)
    args = arguments(tmp_path, max_steps=12)
    given = CoMERATrainer(tiny_llama(), args, train_dataset=RepeatingTokens(), settings=settings, early=8)
    given.train()
    assert ("prune" in {e["event"] for e in given.comera_callback.events}) and given.objective.ratio() < 0.9
    trainer = CoMERATrainer(
        args=args,
        model_init=lambda: tiny_llama(),
        train_dataset=RepeatingTokens(),
        settings=settings,
        early=8,
    )
    for _ in range(2):
        trainer.train()
        assert trainer.objective.model is trainer.model
        assert trainer.comera_callback.events == given.comera_callback.events
        assert [c for c in trainer.callback_handler.callbacks if type(c).__name__ == "CoMERACallback"] == [
            trainer.comera_callback
        ]
        for ours, theirs in zip(trainer.model.parameters(), given.model.parameters()):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_a_fraction_of_max_steps_starts_the_late_stage(tmp_path):
    args = arguments(tmp_path, max_steps=8)
    trainer = CoMERATrainer(
        tiny_llama(), args, train_dataset=RepeatingTokens(), settings=CoMERASettings(prune_at=()), early=0.25
    )
    trainer.train()
    assert [(e["step"], e["event"]) for e in trainer.comera_callback.events][:1] == [(2, "late_stage")]
    assert trainer.comera_callback.early_steps == 2


@pytest.mark.parametrize(
    ("early", "max_steps", "steps"),
    [(0, 10, 0), (3, 10, 3), (30, 10, 10), (0.0, 10, 0), (0.26, 10, 3), (1.0, 7, 7)],
)
def test_early_steps_of(early, max_steps, steps):
    assert early_steps_of(early, max_steps) == steps


@pytest.mark.parametrize("early", [-1, 1.5, -0.1, True, "half", None])
def test_a_bad_early_is_refused_naming_it(early):
    with pytest.raises(ValueError, match="early must be"):
        early_steps_of(early, 10)


def test_unsupported_settings_are_refused_naming_them(tmp_path):
    data = RepeatingTokens()
    with pytest.raises(ValueError, match="no gated layers"):
        CoMERATrainer(LlamaForCausalLM(llama_config()), arguments(tmp_path), train_dataset=data)
    with pytest.raises(ValueError, match="early must be"):
        CoMERATrainer(tiny_llama(), arguments(tmp_path), train_dataset=data, early=2.0)
    no_early = CoMERATrainer(tiny_llama(), arguments(tmp_path, max_steps=2), train_dataset=data, early=0)
    with pytest.raises(ValueError, match="target_loss"):  # a late stage without an early one
        no_early.train()


def test_load_best_model_at_end_is_refused_before_training(tmp_path):
    """Loading the best checkpoint at the end would copy a checkpoint saved before a prune into the pruned
    model (other shapes); the trainer refuses the setting when it is built, naming it."""
    args = arguments(
        tmp_path,
        eval_strategy="steps",
        eval_steps=8,
        save_strategy="steps",
        save_steps=8,
        load_best_model_at_end=True,
    )
    with pytest.raises(ValueError, match=r"args\.load_best_model_at_end=True.*comera\.load_pretrained"):
        CoMERATrainer(tiny_llama(), args, train_dataset=RepeatingTokens(), eval_dataset=RepeatingTokens(8))


def test_load_best_model_at_end_set_after_building_is_refused_before_any_step(tmp_path):
    """The same refusal when the field is set on ``trainer.args`` between building and ``train()``: nothing
    is trained and no checkpoint is written (the run would otherwise fail at its end, after a prune)."""
    args = arguments(tmp_path, eval_strategy="steps", eval_steps=8, save_strategy="steps", save_steps=8)
    trainer = CoMERATrainer(
        tiny_llama(), args, train_dataset=RepeatingTokens(), eval_dataset=RepeatingTokens(8)
    )
    trainer.args.load_best_model_at_end = True
    with pytest.raises(ValueError, match=r"args\.load_best_model_at_end=True.*comera\.load_pretrained"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert not list(tmp_path.glob("**/checkpoint-*"))


REFUSED = {
    # transformers wants evaluations at the checkpoints for load_best_model_at_end
    "load_best_model_at_end": (
        {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
        r"args\.load_best_model_at_end=True",
    ),
    "auto_find_batch_size": ({"auto_find_batch_size": True}, r"args\.auto_find_batch_size=True"),
    "enable_jit_checkpoint": ({"enable_jit_checkpoint": True}, r"args\.enable_jit_checkpoint=True"),
    "use_liger_kernel": ({"use_liger_kernel": True}, r"args\.use_liger_kernel=True: Liger"),
    "fp16": ({"fp16": True}, r"args\.fp16=True on the CPU"),
    "fsdp": ({"fsdp": True}, r"args\.fsdp .*must be unset"),
    "optim_target_modules": (
        {"optim_target_modules": ["q_proj"]},
        r"args\.optim_target_modules=\['q_proj'\]",
    ),
    "optim_args-adamw": (
        {"optim": "adamw_torch", "optim_args": "beta1=0.8"},
        r"'beta1' in args\.optim_args with args\.optim='adamw_torch'",
    ),
    "optim_args-sgd": (
        {"optim": "sgd", "optim_args": "momentum=0.9, foo=1"},
        r"'foo' in args\.optim_args with args\.optim='sgd'",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_training_argument_the_trainer_cannot_honour_is_refused_naming_it(tmp_path, case):
    overrides, message = REFUSED[case]
    with pytest.raises(ValueError, match=message) as refusal:
        CoMERATrainer(tiny_llama(), arguments(tmp_path, **overrides), train_dataset=RepeatingTokens())
    assert "\n" not in str(refusal.value)


def test_optim_args_transformers_passes_on_are_taken(tmp_path):
    args = arguments(tmp_path, optim="sgd", optim_args="momentum=0.5,nesterov=true")
    optimizer = CoMERATrainer(tiny_llama(), args, train_dataset=RepeatingTokens()).create_optimizer()
    assert type(optimizer) is torch.optim.SGD
    assert optimizer.defaults["momentum"] == 0.5 and optimizer.defaults["nesterov"] is True


def test_fp16_on_the_cpu_is_fp32_in_transformers_own_trainer(tmp_path):
    """Why ``fp16=True`` on the CPU is refused: Hugging Face's own ``Trainer`` takes it and trains in fp32
    (no autocast, no loss scaler), to the losses of the run without it."""
    losses = {}
    for fp16 in (False, True):
        args = arguments(tmp_path, max_steps=3, logging_steps=1, fp16=fp16)
        trainer = transformers.Trainer(tiny_llama(), args, train_dataset=RepeatingTokens())
        trainer.train()
        assert trainer.accelerator.scaler is None
        losses[fp16] = [record["loss"] for record in trainer.state.log_history if "loss" in record]
    assert losses[True] == losses[False]


@pytest.mark.parametrize(
    ("optim", "chosen", "foreach"),
    [
        ("adamw_torch", None, True),
        ("sgd", None, True),
        ("adamw_torch", (torch.optim.AdamW, {"foreach": False}), False),
    ],
    ids=["adamw", "sgd", "chosen-for-loop"],
)
def test_a_torch_optimizer_that_is_not_fused_steps_with_foreach_kernels(tmp_path, optim, chosen, foreach):
    trainer = CoMERATrainer(
        tiny_llama(),
        arguments(tmp_path, optim=optim),
        train_dataset=RepeatingTokens(),
        optimizer_cls_and_kwargs=chosen,
    )
    assert trainer.create_optimizer().defaults["foreach"] is foreach


def test_foreach_kernels_train_as_the_per_parameter_loop_does(tmp_path):
    weights = []
    for chosen in (None, (torch.optim.AdamW, {"foreach": False})):
        args = arguments(tmp_path, max_steps=12, optim="adamw_torch")
        trainer = CoMERATrainer(
            tiny_llama(),
            args,
            train_dataset=RepeatingTokens(),
            settings=CoMERASettings(lr_cores=1e-2, lr_gates=1e-2, recovery=0.5),
            early=8,
            optimizer_cls_and_kwargs=chosen,
        )
        trainer.train()
        weights.append(dict(trainer.model.named_parameters()))
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        torch.testing.assert_close(value, weights[1][name], rtol=0, atol=1e-6)


def test_an_optimizer_whose_state_a_prune_cannot_slice_is_refused_when_the_run_prunes(tmp_path):
    args = arguments(tmp_path, optim="adafactor")
    with pytest.raises(ValueError, match="args.optim='adafactor'"):
        CoMERATrainer(tiny_llama(), args, train_dataset=RepeatingTokens())
    trainer = CoMERATrainer(
        tiny_llama(), args, train_dataset=RepeatingTokens(), settings=CoMERASettings(prune_at=())
    )
    optimizer = trainer.create_optimizer()
    assert type(optimizer).__name__ == "Adafactor"
    assert [group["name"] for group in optimizer.param_groups] == ["cores", "gates", "other"]


def test_optimizer_cls_and_kwargs_is_built_on_comera_groups(tmp_path):
    trainer = CoMERATrainer(
        tiny_llama(),
        arguments(tmp_path),
        train_dataset=RepeatingTokens(),
        settings=SETTINGS,
        optimizer_cls_and_kwargs=(torch.optim.SGD, {"momentum": 0.5}),
    )
    optimizer = trainer.create_optimizer()
    assert type(optimizer) is torch.optim.SGD
    groups = {group["name"]: group for group in optimizer.param_groups}
    assert set(groups) == {"cores", "gates", "other"}
    assert groups["cores"]["lr"] == SETTINGS.lr_cores and groups["other"]["momentum"] == 0.5


@pytest.mark.parametrize(
    "choice",
    [(torch.optim.AdamW, {"params": [], "lr": 1e-3}), (lambda: None, {})],
    ids=["own-groups", "factory"],
)
def test_an_optimizer_that_cannot_take_comera_groups_is_refused(tmp_path, choice):
    trainer = CoMERATrainer(tiny_llama(), arguments(tmp_path), train_dataset=RepeatingTokens())
    trainer.get_optimizer_cls_and_kwargs = lambda args, model: choice  # what e.g. optim="galore_adamw" gives
    with pytest.raises(ValueError, match="args.optim"):
        trainer.create_optimizer()


def test_comera_trainer_and_the_hf_trainer_land_at_the_same_size(run, tmp_path):
    """The same model, data, settings and 40 steps through comera.train.Trainer: the same events at the same
    steps, the same size, and the same task losses to float rounding (both loops draw their batch order from
    torch's generator seeded with 0, so here they see the same batches; Hugging Face's loss is the model's
    token sum over the batch's token count, comera's the model's mean, which round differently)."""
    model = tiny_llama()
    config = TrainConfig(
        early=EARLY,
        late=STEPS - EARLY,
        unit="step",
        batch_size=BATCH,
        lr_other=1e-2,
        grad_clip=run.args.max_grad_norm,
        log_every=run.args.logging_steps,
        run_dir=tmp_path,
        compile=False,
        progress=False,
        plot=False,
        reuse_cpu_memory=False,
    )
    objective = CoMERAObjective(model, SETTINGS)
    fit = Trainer(model, lm_loss, RepeatingTokens(), config=config, objective=objective).fit()
    assert fit.step == STEPS
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ours = [(r["step"], r["event"]) for r in records if r.get("kind") == "event"]
    assert ours == [(e["step"], e["event"]) for e in run.comera_callback.events]
    ours_losses = [r["loss"] for r in records if r.get("kind") == "train"]
    theirs_losses = [r["comera_task_loss"] for r in train_logs(run)]
    assert ours_losses == pytest.approx(theirs_losses, rel=1e-4)
    assert objective.ratio() == pytest.approx(SETTINGS.target_ratio, rel=0.05)
    assert objective.ratio() == pytest.approx(run.objective.ratio(), abs=0.02)
    ours_params = comera.compression_report(model).model_params
    assert ours_params == pytest.approx(comera.compression_report(run.model).model_params, rel=0.02)
