"""Run torchtitan's own config parsing and degree checks on emitted torchtitan.toml files.

    python scripts/check_torchtitan_config.py /path/to/torchtitan out/torchtitan.toml [...]

Each file goes through torchtitan's `ConfigManager` (the TOML loaded into its `JobConfig`
dataclasses, types checked by tyro) and its `ParallelDims` check at the world size the degrees
multiply to. Needs a torchtitan checkout (the release pipectl.emit.vendored pins), torch and tyro;
no GPU. torchtitan's package `__init__` is skipped: it registers quantization kernels that import
triton, which the config does not use.
"""

from __future__ import annotations

import sys
import types


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    root, paths = sys.argv[1], sys.argv[2:]
    package = types.ModuleType("torchtitan")
    package.__path__ = [f"{root}/torchtitan"]
    sys.modules["torchtitan"] = package
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    for path in paths:
        config = ConfigManager().parse_args(["--job.config_file", path])
        p, training = config.parallelism, config.training
        world = p.data_parallel_replicate_degree * p.data_parallel_shard_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree
        ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree, cp=1,
                     tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree, ep=1, etp=1, world_size=world)
        print(f"{path}: accepted at world size {world}: replicate {p.data_parallel_replicate_degree}, shard "
              f"{p.data_parallel_shard_degree} (reshard {p.fsdp_reshard_after_forward}), tp {p.tensor_parallel_degree}, "
              f"pp {p.pipeline_parallel_degree} {p.pipeline_parallel_schedule}, "
              f"{len(p.module_fqns_per_model_part or [])} stages, local batch {training.local_batch_size}, global "
              f"{training.global_batch_size}, {training.mixed_precision_param}, checkpointing {config.activation_checkpoint.mode}")


if __name__ == "__main__":
    main()
