"""torch.compile of the whole training step (forward, objective, backward, optimizer step) matches eager.

Backend ``eager`` (Dynamo graph capture, guards and recompilation, without AOTAutograd or code generation)
keeps the test affordable on a small shared CPU; the run crosses a prune and the stage switch.
"""

import torch
from tiny import loss_fn, make_data, make_model, parameters_of

from comera.methods.comera import CoMERAObjective
from comera.train import TrainConfig, Trainer
from comera.train.config import AUTO_COMPILE_MIN_STEPS


def run(compile_step: bool):
    model = make_model(dropout=0.0, dead_gate=True)
    config = TrainConfig(
        early=2, late=1, unit="step", batch_size=16, compile=compile_step, compile_backend="eager"
    )
    objective = CoMERAObjective(model, gamma=1.0, lr_gates=0.05, prune_at=("early_end",))
    result = Trainer(model, loss_fn, make_data(), config=config, objective=objective).fit()
    return model, result


def test_compiled_step_matches_eager_across_prune_and_stage_switch():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled, compiled_result = run(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2, "nothing was compiled"
    eager, eager_result = run(False)
    assert compiled_result.stage == eager_result.stage == "late"
    assert compiled[0].max_ranks == eager[0].max_ranks != make_model()[0].max_ranks
    got, want = parameters_of(compiled), parameters_of(eager)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_auto_compiles_only_long_cpu_runs():
    def compiles(steps, setting):
        config = TrainConfig(early=steps, unit="step", batch_size=16, compile=setting)
        return Trainer(make_model(), loss_fn, make_data(), config=config).compiles()

    assert compiles(AUTO_COMPILE_MIN_STEPS, "auto") and not compiles(AUTO_COMPILE_MIN_STEPS - 1, "auto")
    assert not compiles(AUTO_COMPILE_MIN_STEPS, False) and compiles(5, True)
