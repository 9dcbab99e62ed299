"""Run Megatron-LM's own argument checks on emitted megatron-args.sh files.

    PYTHONPATH=/path/to/Megatron-LM python scripts/check_megatron_args.py out/megatron-args.sh [...]

Each file is sourced by bash as a launch script would; its PIPECTL_MEGATRON_ARGS, beside the
arguments a user's script adds (a mock dataset, a tokenizer, an iteration count, a learning rate),
go through Megatron's `parse_args`, `validate_args` and `core_transformer_config_from_args` (which
checks the pipeline layout or the first/last stage counts) with WORLD_SIZE set to the file's. It
prints the degrees and the cut Megatron derived, or its error. Needs a Megatron-LM checkout (the
release pipectl.emit.vendored pins) and torch; no GPU: on a host without one the device generation
Megatron asks CUDA for is taken as an A100's, and without Transformer Engine rope fusion is off.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys


def words_of(path: str) -> tuple[list[str], dict[str, str]]:
    """The file's PIPECTL_MEGATRON_ARGS and the variables it sets, as bash sees them."""
    script = (f'source "{path}"; printf "%s\\n" "${{PIPECTL_MEGATRON_ARGS[@]}}"; '
              'echo "=CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"; echo "=WORLD_SIZE=$PIPECTL_WORLD_SIZE"')
    lines = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    env = dict(line[1:].split("=", 1) for line in lines if line.startswith("="))
    return [line for line in lines if not line.startswith("=")], {k: v for k, v in env.items() if v}


def check(path: str) -> None:
    import torch
    import megatron.training.arguments as arguments

    words, env = words_of(path)
    os.environ.update(env, RANK="0", LOCAL_RANK="0")
    if not torch.cuda.is_available():
        arguments.get_device_arch_version = lambda: 8  # an A100's generation: no GPU here to ask
    user = ["--train-iters", "10", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257",
            "--mock-data"]
    if importlib.util.find_spec("transformer_engine") is None:
        user.append("--no-rope-fusion")
    sys.argv = ["pretrain_gpt.py", *words, *user]
    args = arguments.parse_args()
    arguments.validate_args(args, {})
    config = arguments.core_transformer_config_from_args(args)
    print(f"{path}: accepted: t {args.tensor_model_parallel_size} p {args.pipeline_model_parallel_size} "
          f"virtual {args.virtual_pipeline_model_parallel_size} d {args.data_parallel_size}, first/last "
          f"{config.num_layers_in_first_pipeline_stage}/{config.num_layers_in_last_pipeline_stage}, layout "
          f"{config.pipeline_model_parallel_layout}, recompute {config.recompute_granularity}, "
          f"sequence parallel {config.sequence_parallel}")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    failed = 0
    for path in sys.argv[1:]:
        try:
            check(path)
        except (AssertionError, ValueError, SystemExit) as error:  # Megatron's own refusals
            failed += 1
            print(f"{path}: refused: {type(error).__name__}: {error}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
