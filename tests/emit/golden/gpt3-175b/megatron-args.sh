# shellcheck shell=bash disable=SC2034
# pipectl 0.1.0: Megatron-LM settings for plan gpt3-175b-megatron/plan.json (sha256 c455707960b1), profile profile-3cabdcec96e7.json
# model gpt3-175b, global batch 1536, cluster a100-384x8
# layout t4p16d48 interleaved b1 m32 v4 ZeRO-1 on 3072 x a100-80gb (384 nodes of 8): predicted 7.136 s/step, peak 70.4 GiB per device
#
# What this framework does that pipectl's prediction did not price (how far the step time holds here):
# - not priced (the profile times pipectl's own layers): fused kernels (Transformer Engine or Apex where installed): a shorter step
# - not priced (the profile times pipectl's own layers): sequence parallelism: norms and dropouts keep 1/t of their activations, less memory
# - not priced (the profile times pipectl's own layers): the vocabulary-parallel embedding and head: 1/t of their time and memory per tensor rank
# - not priced: its fp32 cross-entropy (vocabulary-parallel, keeping its softmax) needs up to 6 bytes more per logit on the last stage than the chunked loss pipectl priced
# - with --bf16 Megatron reduces gradients in fp32: twice the data-parallel bytes priced
# - Megatron's attention and hidden dropout (0.1 each unless set to 0) is not priced
# - --use-distributed-optimizer is priced as ZeRO-1: optimizer state split over the replicas

# Source this file in a Megatron-LM launch script, then pass the array to pretrain_gpt.py:
#   torchrun --nnodes "$PIPECTL_NODES" --nproc-per-node "$PIPECTL_GPUS_PER_NODE" ... pretrain_gpt.py \
#       "${PIPECTL_MEGATRON_ARGS[@]}" <your data, tokenizer, optimizer and checkpoint arguments>
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron's validate_args asks it of tensor parallelism (before Blackwell)
PIPECTL_WORLD_SIZE=3072
PIPECTL_NODES=384
PIPECTL_GPUS_PER_NODE=8
PIPECTL_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --ffn-hidden-size 49152
    --seq-length 2048 --max-position-embeddings 2048
)
PIPECTL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 4
    --sequence-parallel
    --pipeline-model-parallel-size 16
    --pipeline-model-parallel-layout 'Et|(t*2|)*33(t|)*29L'
    --use-tp-pp-dp-mapping
    --micro-batch-size 1 --global-batch-size 1536
    --use-distributed-optimizer
    --bf16
)
PIPECTL_MEGATRON_ARGS=("${PIPECTL_MODEL_ARGS[@]}" "${PIPECTL_PARALLEL_ARGS[@]}")
