#!/bin/bash
# usage: run_case.sh CASE   (one compile per call; run it under nice on a shared machine)
# The 64-GPU, Llama-2-7B and 128-GPU Llama3-70B cases of issue 39, on top of the shared scripts in $PEER_GPU (read by path,
# not copied): writes $P/res/CASE.json, CASE.hlo.gz, CASE.collectives.json and $P/logs/CASE.log.
# Then: python3 $PEER_GPU/table.py CASE...  and  PYTHONPATH=<jaxtrain tree> python predict.py CASE...
set -u
P=${P:-${TMPDIR:-/tmp}/jaxtrain-gpupeer}
HERE=$(cd "$(dirname "$0")" && pwd)
PEER_GPU=${PEER_GPU:-/work/shared/peer/gpu}
PROJECT=${PROJECT:-$(cd "$HERE/../.." && pwd)}
MT10=${MT10:-$P/mt10g/bin/python}                      # install_mt10g.sh: py3.12, maxtext 0.2.5, jax[cuda12]==0.10.2
JTPY=${JAXTRAIN_GPU_PY:-/work/main/.venv/bin/python}   # a venv with jax[cuda12]==0.10.2 (jaxtrain's gpu-aot extra)
JT10="env PYTHONPATH=$PROJECT $JTPY"                    # jaxtrain from this tree
export JAX_PLATFORMS=cpu DECOUPLE_GCLOUD=TRUE PYTHONDONTWRITEBYTECODE=1 PEER_GPU
MT="hardware=gpu dataset_type=synthetic enable_checkpointing=False enable_goodput_recording=False \
skip_jax_distributed_system=True jax_cache_dir= base_output_directory=$P/runs/out run_name=gpupeer \
scan_layers=True remat_policy=full per_device_batch_size=1 attention=cudnn_flash_jax"
# 64 H100s = MaxText's a3 (8 GPUs a node) x 8 nodes (the device count). The devices come from topology
# 1x8x8 (8 hosts); num_slices=1 builds MaxText's mesh over all 64 as one ICI mesh: its GPU branch of
# create_device_mesh sorts by device id and reshapes, so the last mesh axis (expert) is within a node and
# fsdp across nodes, as jaxtrain's dcn.fsdp=8. (MaxText's DCN route, num_slices=8 + dcn_*_parallelism,
# groups devices by slice_index, which is 0 on all 64 compile-only devices: case mtmx64-dcn.)
MT64="compile_topology=a3 compile_topology_num_slices=8 num_slices=1"
MT8="compile_topology=a3 compile_topology_num_slices=1"
MT128="compile_topology=a3 compile_topology_num_slices=16 num_slices=1"   # 128 H100s: 16 nodes x 8, topology 1x16x8
JT="--device H100 --compile --json --set model.scan_layers=true --set model.remat=full --set train.microbatches=1"
# Mixtral 8x7B, 64 GPUs: expert=8 within a node, fsdp=8 across nodes; 1 x 4096 tokens per GPU (global 64 x 4096);
# capacity-based routing (factor 1.25, tokens dropped past capacity) on both sides
MTMX="model_name=mixtral-8x7b max_target_length=4096 ici_fsdp_parallelism=8 ici_expert_parallelism=8 sparse_matmul=False capacity_factor=1.25"
JTMX="--config mixtral-8x7b --mesh fsdp=8,expert=8,dcn.fsdp=8 --set train.batch_size=64 --set train.seq_len=4096"
# Llama 3.1 70B, 64 GPUs, fsdp=64 (8 within a node x 8 across); 1 x 8192 tokens per GPU
MT70="model_name=llama3.1-70b max_target_length=8192 ici_fsdp_parallelism=64"
JT70="--config llama3.1-70b --mesh fsdp=64,dcn.fsdp=8 --set train.batch_size=64 --set train.seq_len=8192"
# Llama3-70B, 128 GPUs, fsdp=128 (8 within a node x 16 across); 1 x 8192 tokens per GPU (global 128 x 8192):
# NGC's measured MaxText Llama3-70B point (1,052 tokens/s/GPU). MaxText 0.2.5 has model_name=llama3-70b
# (configs/models/llama3-70b.yml, the same fields as llama3.1-70b.yml); jaxtrain's preset is llama3.1-70b.
MT70128="model_name=llama3-70b max_target_length=8192 ici_fsdp_parallelism=128"
JT70128="--config llama3.1-70b --mesh fsdp=128,dcn.fsdp=16 --set train.batch_size=128 --set train.seq_len=8192"
# Llama-2-7B (JAX-Toolbox's MaxText measurement: 8 H100s, bf16, global batch 16 x 4096)
MT27="model_name=llama2-7b max_target_length=4096 ici_fsdp_parallelism=8 per_device_batch_size=2"
JT27="--config llama3-8b --mesh fsdp=8 --set model.vocab_size=32000 --set model.n_kv_heads=32 --set model.d_ff=11008 \
--set model.rope_theta=10000.0 --set train.batch_size=16 --set train.seq_len=4096"
# jaxtrain's run.xla_flags=gpu-default preset (jaxtrain/parallel/xla_flags.py), given to MaxText's compile as XLA_FLAGS
GPUDEFAULT="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_highest_priority_async_stream=true \
--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true --xla_gpu_enable_pipelined_all_reduce=true \
--xla_gpu_enable_while_loop_double_buffering=true --xla_gpu_all_gather_combine_threshold_bytes=134217728 \
--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728 --xla_gpu_all_reduce_combine_threshold_bytes=134217728 \
--xla_gpu_enable_all_gather_combine_by_dim=false --xla_gpu_enable_reduce_scatter_combine_by_dim=false --xla_gpu_enable_triton_gemm=false"
# llama3-1b at the GPU kit's shape and math (../shared/peer/gpu-device/run.sh), ONE compile-only H100: batch 4 x 2048,
# MaxText remat minimal. MaxText takes the device count from a3 (8): per_device_batch_size=0.5 is a global batch of 4.
# jaxtrain's side is tools/peer_gpu/kernels.py (it compiles the step with one-document rows itself).
MT1B="model_name=default decoder_block=llama2 base_emb_dim=2048 base_num_query_heads=32 base_num_kv_heads=8 base_mlp_dim=8192 \
base_num_decoder_layers=16 head_dim=64 vocab_size=128256 max_target_length=2048 rope_max_timescale=500000 logits_via_embedding=True \
learning_rate=3e-4 steps=1000 warmup_steps_fraction=0.1 normalize_embedding_logits=False normalization_layer_epsilon=1e-5 \
dtype=bfloat16 weight_dtype=float32 opt_type=adamw adam_b1=0.9 adam_b2=0.95 adam_eps=1e-8 adam_weight_decay=0.1 \
gradient_clipping_threshold=1.0 learning_rate_final_fraction=0.1 enable_dropout=False dropout_rate=0.0 monitor_goodput=False"
mkdir -p $P/res $P/logs $P/runs
C=$1; shift
cd $P
case $C in
  mt1b4)   cmd="env NDEV=1 HOSTS=1 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT8 $MT1B per_device_batch_size=0.5 remat_policy=minimal" ;;
  mt1b4-full) cmd="env NDEV=1 HOSTS=1 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT8 $MT1B per_device_batch_size=0.5 remat_policy=full" ;;
  mtmx64)  cmd="env NDEV=64 HOSTS=8 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT64 $MTMX" ;;
  mtmx64-dropless) cmd="env NDEV=64 HOSTS=8 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT64 $MTMX sparse_matmul=True megablox=False capacity_factor=-1" ;;
  mtmx64-dcn) cmd="env NDEV=64 HOSTS=8 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT compile_topology=a3 compile_topology_num_slices=8 model_name=mixtral-8x7b max_target_length=4096 dcn_fsdp_parallelism=8 dcn_data_parallelism=1 ici_fsdp_parallelism=1 ici_expert_parallelism=8 sparse_matmul=False capacity_factor=1.25" ;;
  mtmx64-gpudefault) export XLA_FLAGS="$GPUDEFAULT"; cmd="env NDEV=64 HOSTS=8 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT64 $MTMX" ;;
  jtmx64-gpudefault) cmd="$JT10 $PEER_GPU/jt_gpu_compile.py res/$C.json $JTMX $JT --set run.xla_flags=gpu-default" ;;
  jtmx64)  cmd="$JT10 $PEER_GPU/jt_gpu_compile.py res/$C.json $JTMX $JT" ;;
  jtmx64-dropless) cmd="$JT10 $PEER_GPU/jt_gpu_compile.py res/$C.json $JTMX $JT --set model.moe_dropless=true" ;;
  mt70b64) cmd="env NDEV=64 HOSTS=8 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT64 $MT70" ;;
  mt70b64-gpudefault) export XLA_FLAGS="$GPUDEFAULT"; cmd="env NDEV=64 HOSTS=8 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT64 $MT70" ;;
  jt70b64) cmd="$JT10 $PEER_GPU/jt_gpu_compile.py res/$C.json $JT70 $JT" ;;
  jt70b64-gpudefault) cmd="$JT10 $PEER_GPU/jt_gpu_compile.py res/$C.json $JT70 $JT --set run.xla_flags=gpu-default" ;;
  mt70b128) cmd="env NDEV=128 HOSTS=16 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT128 $MT70128" ;;
  jt70b128) cmd="$JT10 $PEER_GPU/jt_gpu_compile.py res/$C.json $JT70128 $JT" ;;
  mt70b128-gpudefault) export XLA_FLAGS="$GPUDEFAULT"; cmd="env NDEV=128 HOSTS=16 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT128 $MT70128" ;;
  jt70b128-gpudefault) cmd="$JT10 $PEER_GPU/jt_gpu_compile.py res/$C.json $JT70128 $JT --set run.xla_flags=gpu-default" ;;
  mt2-7b8) cmd="env NDEV=8 HOSTS=1 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT8 $MT27" ;;
  mt2-7b8-gpudefault) export XLA_FLAGS="$GPUDEFAULT"; cmd="env NDEV=8 HOSTS=1 $MT10 $HERE/mt_compile_hosts.py res/$C.json $MT $MT8 $MT27" ;;
  jt2-7b8-gpudefault) cmd="$JT10 $PEER_GPU/jt_gpu_compile.py res/$C.json $JT27 $JT --set run.xla_flags=gpu-default" ;;
  jt2-7b8) cmd="$JT10 $PEER_GPU/jt_gpu_compile.py res/$C.json $JT27 $JT" ;;
  *) echo "unknown case $C"; exit 2 ;;
esac
echo "XLA_FLAGS=${XLA_FLAGS:-} $cmd $*" > logs/$C${TAG:-}.cmd
t0=$(date +%s.%N)
/usr/bin/time -v $cmd "$@" > logs/$C${TAG:-}.log 2>&1
rc=$?
t1=$(date +%s.%N)
maxrss=$(grep "Maximum resident" logs/$C${TAG:-}.log | awk '{print $NF}')
echo "$C${TAG:-} rc=$rc wall=$(echo "$t1 - $t0" | bc) maxrss_kb=$maxrss" | tee -a logs/cases.txt
grep -E "^(MT_GPU|JT_GPU)" logs/$C${TAG:-}.log | cut -c1-1500
