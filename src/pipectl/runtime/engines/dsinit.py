"""Starting DeepSpeed inside a rank: the work-arounds measured on CPU machines, in one place.

See /work/shared/DEEPSPEED-ON-CPU.md for the measurements behind each step:

- DeepSpeed's first `init_distributed()` JIT-compiles a shared-memory all-reduce op (43-90 s on
  two cores, and 66 MiB of /dev/shm leaked per master port under its launcher). Training never
  uses it (it serves inference all-reduce only), so we replace `build_shm_op` in
  `deepspeed.comm.torch` with a function that returns None, which DeepSpeed already treats as
  "op not available". The module must be fetched with `importlib.import_module`: the package
  re-exports the name `torch`, so `import deepspeed.comm.torch as m` yields torch itself.
- One OpenMP thread per rank: with two threads, 20 steps at p=2 went from 1.3 s to 6.3 s.
- `DS_ACCELERATOR=cpu` when no GPU is visible, which silences the accelerator warning.
- A collective timeout for every group: `init_process_group(timeout=...)` sets it for the default
  group only. DeepSpeed builds its pipeline and data-parallel groups with `new_group(ranks)`, which
  takes torch's module default (`distributed_c10d.default_pg_timeout`, 30 min for gloo, read when
  the group is made), so that default is set to the job's timeout as well, before DeepSpeed makes
  any group (`liveness` says why and how long).
"""

from __future__ import annotations

import importlib
import os
import socket
from datetime import timedelta

_SHM_PATCHED = False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (the OS picks it), for a job's master/rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def set_rank_environment() -> None:
    """Environment defaults every rank needs before torch/DeepSpeed do real work.

    Existing values win: a launcher (torchrun) or the user may have chosen differently.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch and DeepSpeed are imported here, after the environment they read at import is set.
    import torch

    choose_accelerator()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def cuda_available() -> bool:
    import torch  # only when asked, so the CLI starts without torch

    return torch.cuda.is_available()


def choose_accelerator() -> None:
    """`DS_ACCELERATOR=cpu` when no GPU is visible and nobody chose: quiets DeepSpeed's
    auto-detection warning. Call before DeepSpeed is imported."""
    if "DS_ACCELERATOR" not in os.environ and not cuda_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def skip_shared_memory_op_build() -> None:
    """Make DeepSpeed skip the JIT build of its shared-memory all-reduce op (idempotent)."""
    global _SHM_PATCHED
    if _SHM_PATCHED:
        return
    comm_torch = importlib.import_module("deepspeed.comm.torch")

    def no_shm_op():
        return None

    comm_torch.build_shm_op = no_shm_op
    _SHM_PATCHED = True


def init_distributed(timeout_seconds: float | None = None, store=None) -> None:
    """Environment, shm-op skip, then `deepspeed.init_distributed()` from the env:// variables.

    Expects RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (torchrun, DeepSpeed's
    launcher and our spawn helper all set them). With `store` (a live resize's own rendezvous,
    `runtime.elastic.live_resize`) the group is started on it, and DeepSpeed adopts it.
    """
    set_rank_environment()
    skip_shared_memory_op_build()
    import deepspeed  # after the environment it reads at import is set
    import torch.distributed as torch_dist

    from pipectl.runtime.engines.loopback import keep_stores_on_loopback  # torch: after the environment too

    keep_stores_on_loopback()  # a store this rank hosts for 127.0.0.1 listens there only
    from deepspeed.accelerator import get_accelerator

    backend = get_accelerator().communication_backend_name()
    kwargs = {}
    if timeout_seconds is not None:
        from torch.distributed import distributed_c10d

        kwargs["timeout"] = timedelta(seconds=timeout_seconds)
        distributed_c10d.default_pg_timeout = kwargs["timeout"]  # the groups made later: see above
    if store is not None:
        torch_dist.init_process_group(
            backend, store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), **kwargs
        )
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False, **kwargs)
