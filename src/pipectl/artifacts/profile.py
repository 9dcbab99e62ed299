"""The profile artifact (profile.json, links.json): per-layer costs of a model and per-link costs.

Nothing in a profile depends on the device count of a future job (scale-invariant calibration,
Varuna §4): layer costs are per micro-batch on one device, link costs are fits of
latency + bytes / bandwidth that the planner evaluates for any ring size.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipectl.artifacts.base import MAX_BYTES, MAX_BYTES_PER_SECOND, Artifact, Bytes, BytesPerSecond, Seconds, Sha256, Strict


# A layer's forward FLOPs: 1e30 is 10^12 times GPT-3's whole training run (3.14e23).
MAX_FLOPS = 1e30
# Engine ratios and slowdowns: a layer 10^6 times slower inside the engine than alone is a broken file.
MAX_RATIO = 1e6
MAX_HOST_CORES = 1 << 16


class ProfileSource(str, Enum):
    MEASURED = "measured"
    DERIVED = "derived"


class LinkClass(str, Enum):
    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


class LayerCost(Strict):
    """Costs of one layer at one micro-batch size."""

    micro_batch_size: int = Field(gt=0, description="Samples per micro-batch b.")
    forward_seconds: Seconds = Field(description="Median forward time of the layer.")
    backward_seconds: Seconds = Field(description="Median backward time of the layer.")
    output_activation_bytes: Bytes = Field(description="Bytes of the output (crosses a stage cut).")
    saved_activation_bytes: Bytes = Field(
        description="Bytes the layer keeps for backward; recomputation frees them."
    )
    peak_memory_bytes: Bytes = Field(description="Peak memory while running forward+backward.")
    forward_flops: float = Field(default=0.0, ge=0, le=MAX_FLOPS, description="Forward FLOPs (analytic), 0 if unknown.")
    # Selective recomputation (Korthikanti et al. 2022, §5) of a transformer block: what its
    # attention core keeps and costs. Left out of the file when None, so a profile without them
    # reads and writes as before; the planner then does not offer selective recomputation.
    attention_core_saved_bytes: Bytes | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="Bytes of saved_activation_bytes that belong to the attention core (QK^T scores, softmax, "
        "softmax dropout, attention over V) beyond its inputs q, k, v and its output, which the block keeps "
        "anyway: what selective recomputation frees. 0 for a layer without attention; None: not recorded.",
    )
    attention_core_forward_seconds: Seconds | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="Median forward time of the attention core alone: what selective recomputation adds to the "
        "block's backward. None: not recorded.",
    )


def _working_memory_bytes(parameter_bytes: int, cost: LayerCost) -> int:
    """Peak - (weights + gradients) - saved - output, at least 0 (`LayerProfile.working_memory_bytes`)."""
    held = 2 * parameter_bytes + cost.saved_activation_bytes + cost.output_activation_bytes
    return max(0, cost.peak_memory_bytes - held)


def _cost_at(costs: list[LayerCost], micro_batch_size: int, owner: str) -> LayerCost:
    for entry in costs:
        if entry.micro_batch_size == micro_batch_size:
            return entry
    raise KeyError(f"{owner} has no cost for micro-batch size {micro_batch_size}")


class ShardProfile(Strict):
    """What one rank of a t-way tensor-parallel group holds and runs of a layer that splits.

    Timed on one device with the group's all-reduces skipped (compute only; the planner prices the
    all-reduces from the links), so a small shard's launch-bound time and the activations every rank
    keeps whole (the LayerNorms' inputs, the block's input) are in it, not a division by t.
    """

    tensor_parallel: int = Field(ge=2, description="Tensor-parallel degree t of the group this shard belongs to.")
    parameter_count: int = Field(ge=0, description="Parameters one rank holds: split matrices / t + replicated terms.")
    parameter_bytes: int = Field(ge=0, description="Bytes of those parameters as profiled.")
    costs: list[LayerCost] = Field(
        description="Costs of one rank's shard per micro-batch size (same sizes as the layer's), ascending."
    )

    def working_memory_bytes(self, cost: LayerCost) -> int:
        """As `LayerProfile.working_memory_bytes`, for this shard's parameters."""
        return _working_memory_bytes(self.parameter_bytes, cost)

    def cost(self, micro_batch_size: int) -> LayerCost:
        return _cost_at(self.costs, micro_batch_size, f"t={self.tensor_parallel} shard")


class LayerProfile(Strict):
    """One cuttable layer of the model."""

    index: int = Field(ge=0, description="Position in the layer list.")
    name: str = Field(description="Layer name, e.g. 'embed', 'block.3', 'head'.")
    kind: str = Field(description="Layer type, e.g. 'embedding', 'transformer_block', 'lm_head'.")
    parameter_count: int = Field(ge=0, description="Parameters held by the layer.")
    parameter_bytes: Bytes = Field(description="Bytes of the layer's parameters as profiled.")
    shared_group: str | None = Field(
        default=None, description="Name of a parameter group shared with other layers (tied embeddings)."
    )
    shared_parameter_count: int = Field(
        default=0, ge=0, description="How many of parameter_count belong to shared_group (each holder has a copy)."
    )
    costs: list[LayerCost] = Field(description="One entry per profiled micro-batch size, ascending.")
    costs_from: int | None = Field(
        default=None,
        ge=0,
        description="Index of the identical layer whose measured costs these are (one-instance profiling: "
        "same kind, constructor arguments, parameter shapes and input shape); None: measured itself.",
    )
    shards: list[ShardProfile] = Field(
        default_factory=list,
        # Left out of the file when empty: a profile without shards reads and writes as before.
        exclude_if=lambda shards: not shards,
        description="One rank's shard for each profiled tensor-parallel degree t > 1, ascending in t (layers "
        "that split: transformer blocks). In a profile where some layer has shards, a layer without them is "
        "replicated over the tensor group: each rank runs and holds all of it. A profile without any shards "
        "is planned as before: every layer's time, memory and parameters divided by t.",
    )

    @model_validator(mode="after")
    def _shards_are_shards(self) -> "LayerProfile":
        degrees = [shard.tensor_parallel for shard in self.shards]
        if degrees != sorted(set(degrees)):
            raise ValueError(f"layer {self.name}: shard degrees {degrees} are not distinct and ascending")
        sizes = [cost.micro_batch_size for cost in self.costs]
        for shard in self.shards:
            shard_sizes = [cost.micro_batch_size for cost in shard.costs]
            if shard_sizes != sizes:
                raise ValueError(
                    f"layer {self.name}: its t={shard.tensor_parallel} shard has costs for micro-batch sizes "
                    f"{shard_sizes}, the layer for {sizes} (each size once, ascending, the same as the layer's)"
                )
            # A rank holds at least its 1/t of the layer (what the planner's pruning bounds assume).
            if shard.parameter_count * shard.tensor_parallel < self.parameter_count:
                raise ValueError(
                    f"layer {self.name}: its t={shard.tensor_parallel} shard holds {shard.parameter_count} "
                    f"parameters, less than 1/{shard.tensor_parallel} of {self.parameter_count}"
                )
        return self

    def shard(self, tensor_parallel: int) -> ShardProfile | None:
        """This layer's shard at degree t, or None when it has none."""
        return next((s for s in self.shards if s.tensor_parallel == tensor_parallel), None)

    @model_validator(mode="after")
    def _consistent(self) -> "LayerProfile":
        sizes = [cost.micro_batch_size for cost in self.costs]
        if not sizes or sizes != sorted(set(sizes)):
            raise ValueError(f"layer {self.name!r}: costs must list micro-batch sizes once each, ascending, got {sizes}")
        if self.shared_parameter_count > self.parameter_count:
            raise ValueError(
                f"layer {self.name!r}: shared_parameter_count {self.shared_parameter_count} exceeds "
                f"parameter_count {self.parameter_count}"
            )
        if self.shared_parameter_count and self.shared_group is None:
            raise ValueError(f"layer {self.name!r}: shared_parameter_count {self.shared_parameter_count} without a shared_group")
        return self

    def working_memory_bytes(self, cost: LayerCost) -> int:
        """Bytes the layer's forward and backward allocate and free again, beyond its weights,
        gradients, saved activations and output (the head's fp32 logits and their gradients):
        `peak_memory_bytes` - 2 x `parameter_bytes` - saved - output, at least 0. A profile whose
        peak is only that sum (CPU measurements, older derived profiles) has none."""
        return _working_memory_bytes(self.parameter_bytes, cost)

    def cost(self, micro_batch_size: int) -> LayerCost:
        return _cost_at(self.costs, micro_batch_size, f"layer {self.name}")


class LinkClassFit(Strict):
    """Fitted cost of one link class: time(bytes) = latency + bytes / bandwidth."""

    link_class: LinkClass
    p2p_latency_seconds: Seconds = Field(description="Point-to-point latency (intercept).")
    p2p_bandwidth_bytes_per_second: BytesPerSecond = Field(description="Point-to-point bandwidth (1/slope).")
    p2p_jitter_seconds: Seconds = Field(default=0.0, description="Std. dev. of residuals of p2p.")
    allreduce_latency_seconds: Seconds = Field(
        description="Ring all-reduce per-hop latency alpha: time = 2(D-1)(alpha + bytes/(D*bw))."
    )
    allreduce_bandwidth_bytes_per_second: BytesPerSecond = Field(description="Ring all-reduce bus bandwidth.")


class EngineComputeRatio(Strict):
    """How much slower the layers run inside the training engine than alone, at one micro-batch size.

    The profiler times each layer alone, over and over on the same input (its weights and
    activations stay in cache); inside the engine a stage runs all its layers, then all their
    backwards. ratio = (engine's per-micro-batch time - the engine's fixed overhead) / the
    profiled layers' sum, measured on the whole model on one rank.
    """

    micro_batch_size: int = Field(gt=0, description="Samples per micro-batch b.")
    forward_ratio: float = Field(gt=0, le=MAX_RATIO, description="Engine forward compute / sum of profiled layer forwards.")
    backward_ratio: float = Field(gt=0, le=MAX_RATIO, description="Engine backward compute / sum of profiled layer backwards.")


class HostState(Strict):
    """How busy the host was at a moment that predictions rest on: when a profile was measured
    (`ModelProfile.host`), when a job was launched (`JobSpec.host_at_launch`). Other work on the
    cores slows every measured time alike, so a profile measured on an idle host over-predicts
    the speed of a run on a busy one (and the reverse): `pipectl.cluster.busier_note` says so."""

    cores: int = Field(gt=0, description="Cores this process could run on (its affinity mask).")
    load_average: float = Field(ge=0, description="The host's 1-minute load average (runnable tasks), os.getloadavg.")
    timing_spread: float | None = Field(
        default=None,
        ge=0,
        description="Median over the measured layers and sizes of (slowest - fastest) / median of the timed "
        "runs: how steady the host was while measuring; None where nothing was timed.",
    )

    @property
    def contention(self) -> float:
        """Runnable tasks per core, at least 1: how many times slower a task runs than alone."""
        return max(1.0, self.load_average / self.cores)


class RuntimeCosts(Strict):
    """What a real training step pays besides the layers' own compute, measured once on one rank.

    Scale-invariant calibration (Varuna §4): every term is per micro-batch per stage, per step per
    rank, or per parameter held, so the planner can evaluate it for any layout. Measured by running
    the training engine (DeepSpeed's pipeline engine with pipectl's schedule executor, the launch's
    optimizer and ZeRO stage) on one rank for a model with a single near-free layer (the fixed
    overheads) and for the profiled model (the per-parameter slope and the compute ratios).
    """

    engine: str = Field(description="What was measured, e.g. 'deepspeed 0.19.8 pipeline engine, ZeRO-1, torch AdamW'.")
    forward_overhead_seconds: Seconds = Field(
        description="Per micro-batch and stage: the engine's forward instruction (+ micro-batch load) "
        "around a near-free layer."
    )
    backward_overhead_seconds: Seconds = Field(
        description="Per micro-batch and stage: the engine's backward instruction around a near-free layer."
    )
    step_fixed_seconds: Seconds = Field(
        description="Per step and rank: gradient reduction, optimizer step and loss bookkeeping of a "
        "near-empty model on one rank."
    )
    step_seconds_per_parameter: Seconds = Field(
        description="Per step and rank: extra end-of-step time per parameter the rank holds "
        "(gradient flattening, clipping, Adam update, copy-back)."
    )
    compute_ratios: list[EngineComputeRatio] = Field(
        default_factory=list, description="Per profiled micro-batch size, ascending; empty means 1."
    )
    calibration_parameter_count: int = Field(
        default=0, ge=0, description="Parameters of the model the slope was measured on."
    )
    busy_handoff_seconds: Seconds = Field(
        default=0.0,
        ge=0,
        description="One blocking message between two ranks of this host after both had been computing: from "
        "both being ready until the receiver runs again (p2p and collectives alike). About the link latency "
        "when the host has idle cores; the scheduler's wait when it is over-subscribed. 0: not measured.",
    )
    alone_compute_slowdown: float = Field(
        default=1.0,
        gt=0,
        le=MAX_RATIO,
        description="Wall-clock / CPU time of one rank computing on this host: 1 when it has a core to itself, "
        "1.5 when other jobs take a third of it (the profile's medians of short runs are close to CPU time). "
        "1: not measured.",
    )
    concurrent_compute_slowdown: float = Field(
        default=1.0,
        gt=0,
        le=MAX_RATIO,
        description="Wall-clock time of each rank's compute while `concurrent_ranks` ranks of this host compute "
        "at once, over its CPU time alone: the cores other jobs leave, and what the ranks take from each other "
        "(shared cache and memory bandwidth). 1: not measured.",
    )
    busy_allreduce_latency_seconds: Seconds = Field(
        default=0.0,
        ge=0,
        description="Ring all-reduce per-hop latency between two ranks of this host right after both computed "
        "(from both having arrived to both done). 0: not measured.",
    )
    busy_allreduce_bandwidth_bytes_per_second: float = Field(
        default=0.0,
        ge=0,
        le=MAX_BYTES_PER_SECOND,
        description="Ring all-reduce bus bandwidth in the same measurement, from a gradient-sized buffer. "
        "0: not measured.",
    )
    concurrent_ranks: int = Field(default=1, ge=1, description="Ranks computing at once in that measurement.")
    host_cores: int = Field(
        default=0,
        ge=0,
        le=MAX_HOST_CORES,
        description="CPU cores this process could run on when the terms were measured (its affinity). More ranks "
        "than cores computing at once share them: each computes ranks / cores times slower "
        "(`plan.costs.host_compute_slowdown`). 0: not recorded (no scaling beyond the measured ranks).",
    )


class LinkSample(Strict):
    """One raw calibration measurement."""

    op: Literal["p2p", "allreduce"]
    link_class: LinkClass
    ring_size: int = Field(ge=2)
    message_bytes: Bytes = Field(gt=0)
    seconds: float = Field(ge=0, description="Median time of one operation.")


class LinksProfile(Artifact):
    """links.json: calibrated link costs per link class, with the raw samples they came from."""

    schema_version: Literal[1] = 1
    backend: str = Field(description="torch.distributed backend used: gloo or nccl.")
    device: str = Field(description="Catalog name of the device the links were measured between.")
    fits: list[LinkClassFit] = Field(description="One fit per measured link class.")
    samples: list[LinkSample] = Field(default_factory=list, description="Raw measurements.")

    @field_validator("fits")
    @classmethod
    def _one_fit_per_class(cls, fits: list[LinkClassFit]) -> list[LinkClassFit]:
        classes = [fit.link_class.value for fit in fits]
        if not classes:
            raise ValueError("fits is empty: a links file holds at least one fitted link class")
        if len(set(classes)) != len(classes):
            raise ValueError(f"fits repeats a link class: {classes}")
        return fits

    def fit(self, link_class: LinkClass) -> LinkClassFit | None:
        return next((f for f in self.fits if f.link_class == link_class), None)


class EngineFeatures(Strict):
    """What another training engine does that pipectl's own runtime does not (Megatron-Core's
    options), for a derived profile that predicts a run of that engine. Each one is a term of the
    compute, memory or cost model (`profile.derive`, `plan.costs`); a profile with any of them set
    is planned for comparison only: its candidates are not runnable by pipectl (engine none).

    None of these is runnable by pipectl's DeepSpeed or torch runtime: their tensor-parallel
    block keeps the sequence whole, the embedding and head whole on every tensor rank, reduces
    gradients after the last micro-batch and runs eager element-wise kernels.
    """

    name: str = Field(min_length=1, max_length=200, description="The engine these features are of (e.g. 'megatron-core').")
    sequence_parallel: bool = Field(
        default=False,
        description="Sequence parallelism with tensor parallelism (Korthikanti et al. 2022, §4.2.2): the "
        "norms, residual adds and dropouts run on s/t tokens of each rank and keep 1/t of their activations; "
        "each block's all-reduces become an all-gather and a reduce-scatter (the same bytes and ring time).",
    )
    vocab_parallel: bool = Field(
        default=False,
        description="The embedding and the head split t ways by vocabulary (Megatron's VocabParallelEmbedding, "
        "a column-parallel head with a vocab-parallel cross-entropy): 1/t of their time, parameters and "
        "logits per tensor rank, one all-reduce of b s h in the embedding's forward and the head's backward.",
    )
    fused_elementwise: bool = Field(
        default=False,
        description="Fused element-wise kernels (Megatron's own, Apex, Transformer Engine): one-kernel RMSNorm, "
        "fused rotary and SwiGLU, one fused QKV and gate/up GEMM, one scale-mask-softmax pass (unfused "
        "attention) instead of eager PyTorch's separate passes.",
    )
    gradient_accumulation_fusion: bool = Field(
        default=False,
        description="Weight gradients accumulated into fp32 main gradients by the weight-gradient GEMM itself "
        "(Megatron-Core's --gradient-accumulation-fusion, on by default): no separate accumulation pass.",
    )
    tensor_parallel_overlap: bool = Field(
        default=False,
        description="Tensor-parallel communication overlapped with the block's GEMMs (Megatron's --tp-comm-overlap, "
        "which needs sequence parallelism) where the tensor group sits inside one node: a block exposes what its "
        "communication exceeds its compute by, and never less than what the compute loses to it.",
    )
    gradient_reduce_overlap: bool = Field(
        default=False,
        description="Data-parallel gradient reduction in buckets during the backward of each stage's last "
        "micro-batch (Megatron's --overlap-grad-reduce): exposed only where it outlasts that backward, and "
        "never less than its last bucket.",
    )
    parameter_gather_overlap: bool = Field(
        default=False,
        description="The distributed optimizer's all-gather of updated parameters overlapped with the next step's "
        "first forward (Megatron's --overlap-param-gather, which needs the distributed optimizer and "
        "--overlap-grad-reduce). Without it the all-gather half of the ring is exposed at the end of the step.",
    )
    gradients_reduced_in_fp32: bool = Field(
        default=False,
        description="Gradients reduced across data-parallel replicas in fp32, 4 bytes each, whatever the training "
        "dtype (Megatron with --bf16 forces --accumulate-allreduce-grads-in-fp32: megatron/training/arguments.py; "
        "its gradient buffers are then fp32, megatron/core/distributed/distributed_data_parallel.py): the "
        "all-reduce, the distributed optimizer's reduce-scatter, ZeRO-2/3's reduce-scatters and the tied "
        "embedding's all-reduce move 4 bytes per parameter; parameter all-gathers stay in the training dtype. "
        "The gradient buffers hold 4 bytes a parameter too, and the optimizer step needs no fp32 copy of them "
        "(`plan.memory.state_dtype`).",
    )
    dropout: bool = Field(
        default=False,
        description="The run's attention and hidden dropout (Megatron-LM's defaults, 0.1 each; pipectl's built-in "
        "GPT has none): with unfused attention a dropout over the s x s probabilities (read, write, a 1-byte mask; "
        "its output and mask kept for the backward), and each residual add's 1-byte mask (Megatron's fused "
        "bias-dropout-add). Flash attention drops inside its kernel: nothing more.",
    )
    uniform_stages: bool = Field(
        default=False,
        description="Transformer blocks split evenly over the (virtual) pipeline stages, the embedding on the "
        "first and the final norm and head on the last (Megatron's num_layers // p // v per stage; "
        "Megatron-DeepSpeed's partition_method 'type:transformer'); where the blocks do not divide, the first "
        "and last stages take one fewer. Without it the planner balances the stages' time. A cut pipectl's "
        "runtime can run too.",
    )
    blocking_p2p: bool = Field(
        default=False,
        description="Pipeline transfers that hold both ranks until they meet (DeepSpeed's pipeline engine: "
        "deepspeed/runtime/pipe/p2p.py sends and receives synchronously, torch.distributed.send/recv, a "
        "broadcast in a two-rank group before torch 1.8): timed as rendezvous, as gloo's are "
        "(`plan.simulate`), not as edge delays beside the compute. A property of the engine pipectl's "
        "DeepSpeed runtime shares, so it does not make a plan unrunnable.",
    )
    launch_blocking: bool = Field(
        default=False,
        exclude_if=lambda value: not value,
        description="Every CUDA launch waits for its kernel to end (CUDA_LAUNCH_BLOCKING=1, which BigScience's "
        "BLOOM run set against hangs: train/tr11-176B-ml/tr11-176B-ml.slurm): the host's per-kernel time adds to "
        "each kernel's instead of running ahead of the GPU (`compute_model.phase_seconds`).",
    )
    gradients_all_reduced: bool = Field(
        default=False,
        exclude_if=lambda value: not value,
        description="The sharded optimizer's gradients all-reduced whole, not reduce-scattered: DeepSpeed's "
        "BF16_Optimizer under its pipeline engine (bf16 at ZeRO stage 0: deepspeed/runtime/pipe/engine.py "
        "_bf16_reduce_grads, buffered_allreduce_fallback, in the training dtype: engine.communication_data_type) "
        "all-reduces every gradient, then each replica updates its shard and all-gathers the parameters "
        "(bf16_optimizer.py step, all_gather_dp_groups): a full ring plus the all-gather's half.",
    )
    megatron_deepspeed_layer: bool = Field(
        default=False,
        exclude_if=lambda value: not value,
        description="The transformer layer as Megatron-DeepSpeed's code issues it (megatron/model/transformer.py "
        "ParallelTransformerLayer, megatron/core/tensor_parallel/layers.py, as of late 2023, under DeepSpeed's "
        "pipeline engine and a PyTorch whose TorchScript fuser is nvfuser, 1.10-2.1): the QKV and fc2 biases "
        "added by kernels of their own, not in the GEMMs; two blocking copies of a scalar to the device in each "
        "forward (the layer's moe_loss and mlp_bias, torch.tensor(0.0, device=...): the host waits for the GPU "
        "each time); in the backward, each fused bias-dropout-add's own kernel, Apex LayerNorm's third kernel "
        "per norm and baddbmm's two products by its scale, while the context's permute stays a view (no copy).",
    )
    bucket_parameters: int = Field(
        default=40_000_000, gt=0, le=10**13,
        description="Parameters per gradient bucket (Megatron-Core's DistributedDataParallel default: "
        "max(40e6, 1e6 x d)); the last bucket's reduction is always exposed.",
    )
    # Fitted to an engine's measured runs (`pipectl calibrate MEASURED.csv`); left out of the file at 0,
    # so a profile without them reads and writes as before.
    micro_batch_overhead_seconds: Seconds = Field(
        default=0.0,
        exclude_if=lambda seconds: seconds == 0,
        description="The engine's time per micro-batch and pipeline stage beyond its kernels (the pipeline "
        "engine's instructions, the micro-batch's load and broadcast to the tensor group, the loss's "
        "bookkeeping), half charged to the forward and half to the backward. 0: not fitted.",
    )
    step_overhead_seconds: Seconds = Field(
        default=0.0,
        exclude_if=lambda seconds: seconds == 0,
        description="The engine's time per step and rank beyond the optimizer's memory traffic and the gradient "
        "reductions (fp16 overflow check, gradient clipping, the engine's bookkeeping). 0: not fitted.",
    )
    source: str | None = Field(default=None, max_length=2000, description="Where these features were read.")

    @property
    def named(self) -> list[str]:
        """The features set, in words and in the schema's order (e.g. ['sequence parallel', 'dropout'])."""
        return [name.replace("_", " ") for name, value in self if isinstance(value, bool) and value]

    @property
    def runnable_by_pipectl(self) -> bool:
        """Whether pipectl's runtime runs a plan priced with these features: only with none set."""
        return not (self.sequence_parallel or self.vocab_parallel or self.fused_elementwise or self.dropout
                    or self.gradient_accumulation_fusion
                    or self.tensor_parallel_overlap or self.gradient_reduce_overlap or self.parameter_gather_overlap
                    or self.gradients_reduced_in_fp32 or self.megatron_deepspeed_layer or self.launch_blocking
                    or self.gradients_all_reduced)


class ModelProfile(Artifact):
    """profile.json: the model layer by layer on one device type."""

    schema_version: Literal[1] = 1
    model: str = Field(description="Model name (config name or 'module:factory').")
    model_reference: str | None = Field(
        default=None,
        description="The model as given to `pipectl profile`: a shipped name, a YAML path, or "
        "'package.module:factory' (code: `launch` imports it). `launch` builds it unless --model names another.",
    )
    source: ProfileSource = Field(description="measured on hardware, or derived from shape + datasheet.")
    device: str = Field(description="Catalog name of the device profiled on (e.g. 'cpu', 'a100-80gb').")
    dtype: str = Field(description="Parameter/activation dtype profiled: float32, bfloat16, float16.")
    micro_batch_sizes: list[int] = Field(description="Micro-batch sizes with costs, ascending.")
    not_fitting_micro_batch_size: int | None = Field(
        default=None, description="First micro-batch size tried that did not fit, if any."
    )
    seq_len: int | None = Field(default=None, gt=0, description="Sequence length (transformers).")
    hidden: int | None = Field(default=None, gt=0, description="Hidden size (transformers).")
    vocab: int | None = Field(default=None, gt=0, description="Vocabulary size (transformers).")
    layers: list[LayerProfile] = Field(min_length=1, description="The cuttable layers, in order.")
    links: LinksProfile | None = Field(default=None, description="Link calibration, when included.")
    runtime: RuntimeCosts | None = Field(
        default=None,
        description="Training-engine overheads measured on one rank (measured profiles); None: not measured.",
    )
    host: HostState | None = Field(
        default=None,
        # Left out of the file when None: a profile without it reads and writes as before.
        exclude_if=lambda host: host is None,
        description="How busy the host was while measuring (measured profiles); None: derived or older.",
    )
    notes: list[str] = Field(default_factory=list, description="What happened while profiling.")
    engine: EngineFeatures | None = Field(
        default=None,
        exclude_if=lambda engine: engine is None,  # a profile of pipectl's runtime reads as it always did
        description="A derived profile of a run of another engine: the features it was derived and is priced "
        "with (`EngineFeatures`); None: pipectl's own runtime.",
    )
    calibration_sha256: Sha256 | None = Field(
        default=None,
        exclude_if=lambda sha: sha is None,
        description="The sha256 of the calibration file whose device figures a derived profile was derived with "
        "(`profile --derive --calibration`); None: the catalog's.",
    )
    device_memory_bytes: int | None = Field(
        default=None,
        gt=0,
        le=MAX_BYTES,
        description="Total memory of the device profiled on as its runtime reports it (CUDA: "
        "torch.cuda.get_device_properties(i).total_memory); None on CPU or when derived. The planner "
        "prefers it to the catalog's figure.",
    )

    @model_validator(mode="after")
    def _same_shard_degrees(self) -> "ModelProfile":
        degrees = {tuple(s.tensor_parallel for s in layer.shards) for layer in self.layers if layer.shards}
        if len(degrees) > 1:
            raise ValueError(f"layers with shards must all have the same degrees, found {sorted(degrees)}")
        return self

    @property
    def has_shards(self) -> bool:
        """Whether any layer has tensor-parallel shard costs (then layers without are replicated)."""
        return any(layer.shards for layer in self.layers)

    @property
    def records_attention_core(self) -> bool:
        """Whether some layer records its attention core (`LayerCost.attention_core_saved_bytes`):
        the planner offers selective recomputation only then."""
        return any(cost.attention_core_saved_bytes is not None for layer in self.layers for cost in layer.costs)

    def shard_degrees(self) -> list[int]:
        """The tensor-parallel degrees t > 1 some layer has shard costs for, ascending."""
        return sorted({shard.tensor_parallel for layer in self.layers for shard in layer.shards})

    @model_validator(mode="after")
    def _consistent(self) -> "ModelProfile":
        """Layer i has index i; every layer has costs at exactly `micro_batch_sizes`; a shared
        layer points at an earlier one; a first size that did not fit lies above the measured ones."""
        sizes = self.micro_batch_sizes
        if not sizes or any(size <= 0 for size in sizes) or sizes != sorted(set(sizes)):
            raise ValueError(f"micro_batch_sizes must be positive, ascending and listed once, got {sizes}")
        for position, layer in enumerate(self.layers):
            if layer.index != position:
                raise ValueError(
                    f"layer {layer.name!r} at position {position} has index {layer.index}: indices must be 0, 1, 2, ... "
                    "in order (a repeated or missing index)"
                )
            layer_sizes = [cost.micro_batch_size for cost in layer.costs]
            if layer_sizes != sizes:
                raise ValueError(
                    f"layer {position} ({layer.name!r}) has costs for micro-batch sizes {layer_sizes}, "
                    f"micro_batch_sizes lists {sizes}"
                )
            if layer.costs_from is not None and not layer.costs_from < len(self.layers):
                raise ValueError(f"layer {position} ({layer.name!r}) takes its costs from layer {layer.costs_from}, "
                                 f"which does not exist")
        if self.not_fitting_micro_batch_size is not None and self.not_fitting_micro_batch_size <= sizes[-1]:
            raise ValueError(
                f"not_fitting_micro_batch_size {self.not_fitting_micro_batch_size} is not above the largest "
                f"profiled size {sizes[-1]}"
            )
        return self

    @property
    def parameter_count(self) -> int:
        """Parameters of the model, counting each shared group once."""
        seen: set[str] = set()
        total = 0
        for layer in self.layers:
            total += layer.parameter_count
            if layer.shared_group:
                if layer.shared_group in seen:
                    total -= layer.shared_parameter_count
                seen.add(layer.shared_group)
        return total
