# shellcheck shell=bash disable=SC2034
# pipectl 0.1.0: Megatron-LM settings for plan llama3-8b-megatron/plan.json (sha256 7614fd69a179), profile profile-64c365a94447.json
# model llama3-8b, global batch 512, cluster a100-8x8
# layout t1p2d32 interleaved b1 m16 v4 ZeRO-1 on 64 x a100-80gb (8 nodes of 8): predicted 8.938 s/step, peak 52.9 GiB per device
#
# What this framework does that pipectl's prediction did not price (how far the step time holds here):
# - not priced (the profile times pipectl's own layers): fused kernels (Transformer Engine or Apex where installed): a shorter step
# - not priced: its fp32 cross-entropy (vocabulary-parallel, keeping its softmax) needs up to 6 bytes more per logit on the last stage than the chunked loss pipectl priced
# - with --bf16 Megatron reduces gradients in fp32: twice the data-parallel bytes priced
# - Megatron's attention and hidden dropout (0.1 each unless set to 0) is not priced
# - --use-distributed-optimizer is priced as ZeRO-1: optimizer state split over the replicas

# Source this file in a Megatron-LM launch script, then pass the array to pretrain_gpt.py:
#   torchrun --nnodes "$PIPECTL_NODES" --nproc-per-node "$PIPECTL_GPUS_PER_NODE" ... pretrain_gpt.py \
#       "${PIPECTL_MEGATRON_ARGS[@]}" <your data, tokenizer, optimizer and checkpoint arguments>
PIPECTL_WORLD_SIZE=64
PIPECTL_NODES=8
PIPECTL_GPUS_PER_NODE=8
PIPECTL_MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --num-attention-heads 32
    --group-query-attention --num-query-groups 8
    --ffn-hidden-size 14336
    --swiglu
    --normalization RMSNorm
    --position-embedding-type rope
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --seq-length 4096 --max-position-embeddings 4096
)
PIPECTL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
    --pipeline-model-parallel-layout 'Et*4|(t*5|)*5t*3|L'
    --use-tp-pp-dp-mapping
    --micro-batch-size 1 --global-batch-size 512
    --use-distributed-optimizer
    --bf16
)
PIPECTL_MEGATRON_ARGS=("${PIPECTL_MODEL_ARGS[@]}" "${PIPECTL_PARALLEL_ARGS[@]}")
