"""Two processes (``torchrun``, gloo, CPU) training on a prepared corpus read disjoint training blocks, and
together every block of the epoch's order once per pass; and ``comera prepare mlm`` then ``comera train mlm``
reads the blocks of the masked LM's packing from the shards."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import torch

from comera.cli import main
from comera.data.token_shards import read_index
from comera.train.data import epoch_seed
from comera.workloads.mlm.packing import pack_documents
from comera.workloads.mlm.prepared import build_prepared_code_data

RECORDING = textwrap.dedent(
    """
    import json, os, sys
    from comera.data.token_blocks import TokenBlocks

    reads = []
    block = TokenBlocks.block

    def recorded(self, number):
        if self.pad_id is None:  # the training split (validation is padded)
            reads.append(int(number))
        return block(self, number)

    TokenBlocks.block = recorded
    from comera.cli import main

    try:
        status = main(sys.argv[2:])
    finally:
        with open(os.path.join(sys.argv[1], f"reads-{os.environ['RANK']}.json"), "w") as file:
            json.dump(reads, file)
    raise SystemExit(status)
    """
)


def test_two_ranks_read_disjoint_blocks_and_together_every_block_once(tmp_path, write_corpus):
    source = write_corpus(tmp_path / "corpus", files=2, lines=200)
    data = tmp_path / "prepared"
    arguments = ["prepare", "llm", "--data", str(source), "--out", str(data), "--preset", "smoke"]
    assert main([*arguments, "--shard-tokens", "1500", "--workers", "0"]) == 0
    script = tmp_path / "recording.py"
    script.write_text(RECORDING)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [str(script), str(tmp_path), "train", "llm", "--preset", "smoke", "--method", "dense"]
    command += ["--data", str(data), "--out", str(tmp_path / "run"), "--cache", str(tmp_path / "cache")]
    command += [
        "--no-progress",
        "--set",
        "train.unit=epoch",
        "--set",
        "train.early=1",
        "--set",
        "train.late=0",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reads = [json.loads((tmp_path / f"reads-{rank}.json").read_text()) for rank in (0, 1)]
    index = read_index(data)
    blocks = index["splits"]["train"]["tokens"] // 32
    batch = 8
    per_rank = blocks // 2 // batch * batch
    assert len(reads[0]) == len(reads[1]) == per_rank > 4 * batch
    assert not set(reads[0]) & set(reads[1]), "a block read by both ranks"
    assert all(len(set(each)) == len(each) for each in reads), "a block read twice in one pass"
    # the reference: the epoch's seeded permutation, cut to a multiple of 2, dealt out in turn
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(epoch_seed(0, 0)))
    order = order[: blocks - blocks % 2]
    assert reads[0] == order[0::2][:per_rank].tolist() and reads[1] == order[1::2][:per_rank].tolist()
    assert blocks - len(reads[0]) - len(reads[1]) < 2 * batch + 2, "blocks left out of the pass"
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["processes"] == 2


def test_prepare_mlm_then_the_blocks_are_the_packing_of_the_shards(tmp_path, capsys):
    source = tmp_path / "code"
    source.mkdir()
    for number in range(40):
        lines = [
            f"def f{number}_{line}(x):\n    return x * {line} + {number}\n" for line in range(number % 7 + 1)
        ]
        (source / f"m{number}.py").write_text("".join(lines))
    with (source / "records.jsonl").open("w") as file:
        for number in range(30):
            file.write(json.dumps({"code": f"class C{number}:\n    value = {number}\n"}) + "\n")
    out = tmp_path / "prepared"
    arguments = ["prepare", "mlm", "--data", str(source), "--out", str(out), "--preset", "smoke"]
    assert main([*arguments, "--set", "data.validation_fraction=0.2", "--no-progress"]) == 0
    assert "encoding: " in capsys.readouterr().out
    index = read_index(out)
    assert index["splits"]["train"]["documents"] + index["splits"]["validation"]["documents"] == 70
    data = build_prepared_code_data(out, cache_dir=tmp_path / "cache", seq_len=16)
    ids = data.ids
    for split, blocks in (("train", data.train), ("validation", data.validation)):
        stream = []
        for entry in index["splits"][split]["shards"]:
            stream += np.fromfile(out / entry["name"], dtype="<u2").tolist()
        wanted = pack_documents([stream[:-1]], 16, ids, fixed_masking=split == "validation")
        assert len(blocks) == len(wanted) > 0
        for index_ in range(len(wanted)):
            got, want = blocks[index_], wanted[index_]
            assert torch.equal(got["input_ids"], want["input_ids"]) and got["length"] == want["length"]
