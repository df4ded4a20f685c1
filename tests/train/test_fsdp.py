"""FSDP2 on 2 CPU processes (gloo): the tiny comera model with its dense head sharded and its TT layers
replicated trains as one process on the combined batches does (early stage, prune, late stage), including the
evaluation; its checkpoints are torch.distributed.checkpoint folders, each rank writing its shards, and a
sharded run resumes in one process or in two (from the folders) and a one-process run resumes sharded;
refused settings name themselves."""

import shutil

import pytest
import torch
from ranks import TOLERANCE, assert_same_end, checkpoint_steps, train, two_ranks
from safetensors.torch import load_file
from tiny import make_model

from comera.train.config import TrainConfig
from comera.train.fsdp import check_sharding, grad_norm, replicated_parameters

STOP_AT = 8


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    return {**train(folder, save_to=folder / "model"), "model": folder / "model"}


def test_two_sharded_processes_match_one(tmp_path, reference):
    ranks = two_ranks(tmp_path, "fsdp", run_dir=tmp_path / "run", parallel="fsdp", save_to=tmp_path / "model")
    assert [code for code, _ in ranks] == [0, 0], [saved["error"] for _, saved in ranks]
    assert_same_end(ranks[0][1]["result"], reference)
    assert sorted(path.name for path in (tmp_path / "model").iterdir()) == [
        "comera_config.json",
        "model.safetensors",
    ]
    config = (tmp_path / "model" / "comera_config.json").read_text()
    assert config == (reference["model"] / "comera_config.json").read_text()
    saved, expected = (
        load_file(folder / "model.safetensors") for folder in (tmp_path / "model", reference["model"])
    )
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, **TOLERANCE, msg=name)
    assert ranks[1][1]["result"]["state"] == {}, "only rank 0 receives the whole state"
    assert ranks[1][1]["result"]["eval"] == ranks[0][1]["result"]["eval"]


def test_sharded_cores_are_pruned_by_a_rebuild_and_two_processes_match_one(tmp_path, reference):
    """shard_cores=True: the TT cores are sharded (the gates whole), the prune at the early stage's end
    rebuilds the sharded model on the pruned shapes, and the run ends as one process on the combined batches
    does; the saved model is the same files."""
    ranks = two_ranks(
        tmp_path,
        "cores",
        run_dir=tmp_path / "run",
        parallel="fsdp",
        shard_cores=True,
        save_to=tmp_path / "model",
        inspect="sharded_cores",
    )
    assert [code for code, _ in ranks] == [0, 0], [saved["error"] for _, saved in ranks]
    result = ranks[0][1]["result"]
    assert_same_end(result, reference)
    assert result["inspected"]["cores_sharded"] and result["inspected"]["gates_whole"]
    assert result["inspected"]["pruned"], "the run pruned (its ranks shrank)"
    saved, expected = (
        load_file(folder / "model.safetensors") for folder in (tmp_path / "model", reference["model"])
    )
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, **TOLERANCE, msg=name)


def test_a_sharded_cores_run_resumes_after_its_prune_in_two_processes_and_in_one(tmp_path, reference):
    """Stopped after the prune, a shard_cores run resumes from its pruned sharded checkpoint in 2 processes
    (rebuilt on the checkpoint's shapes) and in 1, and ends as the uninterrupted run; a 1-process pruned
    checkpoint resumes with sharded cores."""
    sharded = tmp_path / "sharded"
    settings = {"parallel": "fsdp", "shard_cores": True}
    ranks = two_ranks(tmp_path, "first", run_dir=sharded, callback=("stop", STOP_AT), **settings)
    assert [code for code, _ in ranks] == [0, 0], [saved["error"] for _, saved in ranks]
    copy = tmp_path / "sharded-copy"
    shutil.copytree(sharded, copy)
    ranks = two_ranks(tmp_path, "again", run_dir=sharded, resume=True, **settings)
    assert [code for code, _ in ranks] == [0, 0], [saved["error"] for _, saved in ranks]
    assert_same_end(ranks[0][1]["result"], reference)
    assert_same_end(train(copy, resume=True), reference)

    single = tmp_path / "single"
    assert train(single, callback=("stop", STOP_AT)) is None
    ranks = two_ranks(tmp_path, "second", run_dir=single, resume=True, **settings)
    assert [code for code, _ in ranks] == [0, 0], [saved["error"] for _, saved in ranks]
    assert_same_end(ranks[0][1]["result"], reference)


def test_ranks_with_different_numbers_of_evaluation_batches_evaluate_the_gathered_model(tmp_path):
    # 17 examples: rank 0 evaluates 9 (3 batches of at most 4), rank 1 evaluates 8 (2 batches); sharded
    # forward passes would wait for each other, the gathered model's do not
    ranks = two_ranks(tmp_path, "uneven", run_dir=tmp_path / "run", parallel="fsdp", eval_samples=17)
    assert [code for code, _ in ranks] == [0, 0], [saved["error"] for _, saved in ranks]
    first, second = (saved["result"]["eval"] for _, saved in ranks)
    assert first == second and set(first) == {"loss"}


def test_a_sharded_run_resumes_in_one_process_and_the_other_way(tmp_path, reference):
    sharded = tmp_path / "sharded"
    ranks = two_ranks(tmp_path, "first", run_dir=sharded, parallel="fsdp", callback=("stop", STOP_AT))
    assert [code for code, _ in ranks] == [0, 0], [saved["error"] for _, saved in ranks]
    assert checkpoint_steps(sharded)[-1] == STOP_AT
    folders = sorted((sharded / "checkpoints").iterdir())
    assert folders and all(path.is_dir() and path.name.endswith(".dcp") for path in folders)
    for folder in folders:  # each rank wrote its own shards; rank 0 the index and the trainer state
        assert sorted(path.name for path in folder.iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "trainer.pt",
        ]
    copy = tmp_path / "sharded-copy"
    shutil.copytree(sharded, copy)
    assert_same_end(train(sharded, resume=True), reference)
    ranks = two_ranks(tmp_path, "again", run_dir=copy, parallel="fsdp", resume=True)  # folders, 2 -> 2
    assert [code for code, _ in ranks] == [0, 0], [saved["error"] for _, saved in ranks]
    assert_same_end(ranks[0][1]["result"], reference)

    single = tmp_path / "single"
    assert train(single, callback=("stop", STOP_AT)) is None
    ranks = two_ranks(tmp_path, "second", run_dir=single, parallel="fsdp", resume=True)
    assert [code for code, _ in ranks] == [0, 0], [saved["error"] for _, saved in ranks]
    assert_same_end(ranks[0][1]["result"], reference)


def test_refused_settings_name_themselves():
    with pytest.raises(ValueError, match=r"parallel must be one of \('ddp', 'fsdp'\), got 'zero'"):
        TrainConfig(parallel="zero")
    with pytest.raises(ValueError, match="shard_cores must be True or False"):
        TrainConfig(shard_cores=1)
    with pytest.raises(ValueError, match="leave optimizer=None"):
        check_sharding(optimizer_given=True)
    check_sharding(optimizer_given=False)


def test_replicated_parameters_are_those_of_the_tt_layers():
    model = make_model()
    replicated = replicated_parameters(model)
    expected = {*model[0].parameters(), *model[3].parameters()}
    assert replicated == expected and not replicated & set(model[5].parameters())


def test_grad_norm_without_sharded_gradients_is_the_plain_norm():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))]
    params[0].grad, params[1].grad = torch.full((3,), 2.0), torch.full((4,), 1.0)
    assert float(grad_norm(params)) == pytest.approx(4.0)
