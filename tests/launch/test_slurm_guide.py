"""docs/guide/clusters-and-slurm.md's GPT-3 175B example says what its commands produce: they are run
here, as written (the guide's `slurm:` section added to a copy of a100-384x8.yaml as `mine.yaml`, a
token file of our own for /data/tokens.bin), and the layout and nodes the guide names are the ones
the plan chooses and the script asks for. The guide used to say 384 nodes, which only a plan on all
3,072 GPUs (the golden file's) would ask for."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np

from cli_process import pipectl

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs/guide/clusters-and-slurm.md"


def test_the_guides_gpt3_example_names_the_layout_and_nodes_its_commands_produce(tmp_path):
    text = GUIDE.read_text()
    prose = " ".join(text.split())  # the guide's sentences, wherever its lines break
    slurm = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "mine.yaml").write_text((REPO / "configs/clusters/a100-384x8.yaml").read_text() + slurm)
    np.random.default_rng(0).integers(0, 50000, 100_000).astype("uint16").tofile(tmp_path / "tokens.bin")
    block = next(b for b in text.split("```")[1::2] if b.lstrip("\n").startswith("pipectl profile gpt3-175b"))
    commands = [shlex.split(line.replace("/data/tokens.bin", "tokens.bin"), comments=True)
                for line in block.replace("\\\n", " ").splitlines() if line.strip()]  # fmt: skip
    assert [argv[:2] for argv in commands] == [["pipectl", c] for c in ("profile", "plan", "launch")]
    outputs = []
    for argv in commands:
        done = pipectl(*argv[1:], cwd=tmp_path, columns=200)
        assert done.returncode == 0, f"$ {shlex.join(argv)}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    chosen = re.search(r"chosen: (t=\d+ p=\d+ d=\d+) .* on ([\d]+) x a100-80gb", outputs[1])
    nodes = re.search(r"^#SBATCH --nodes=(\d+)$", outputs[2], re.MULTILINE)
    assert chosen and nodes, outputs
    layout, devices, nodes = chosen[1], int(chosen[2]), int(nodes[1])
    assert f"`{layout}` on {devices:,} of the 3,072 GPUs" in prose
    assert f"{nodes} nodes × 8 GPUs (`#SBATCH --nodes={nodes}`" in prose
    assert f"{devices:,} of `a100-384x8`'s A100s: {nodes} nodes × 8 ranks" in prose
    # The resize the guide tells of, of the run launched (not a dry run, there is no sbatch here).
    assert pipectl(*[a for a in commands[2][1:] if a != "--dry-run"], cwd=tmp_path, columns=200).returncode == 0
    resize = pipectl("resize", "runs/gpt3", "--devices", 1024, "--dry-run", cwd=tmp_path, columns=200)
    assert "to 1008 devices: t4p14d18" in " ".join(resize.stdout.split()), resize.stdout
    assert "written anew for 126 nodes x 8 ranks" in " ".join(resize.stdout.split()), resize.stdout
    assert "`resize runs/gpt3 --devices 1024` chooses 1,008 devices (`t=4 p=14 d=18`), 126 nodes × 8" in prose
    # What the guide says the golden file holds: a job on all 384 nodes.
    golden = (REPO / "tests/launch/golden/gpt3-175b-a100-384x8.sbatch").read_text()
    assert "3072 ranks, 384 nodes x 8 GPU ranks, bf16" in golden and "#SBATCH --nodes=384" in golden
    assert "on 3,072 ranks (`t=8 p=16 d=24`, 384 nodes × 8), bf16" in prose
