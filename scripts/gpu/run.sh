#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md, as steps of one script, each under its own time
# limit, each writing its log to $OUT (default /tmp/gpu-out):
#
#   scripts/gpu/run.sh setup env tests probe attention decode train ...
#
# `setup` installs jaxllm (editable, no dependencies) into the machine's Python and, when a
# `.whl/` folder is present, the wheels in it (packages the machine's image lacks) to /tmp/site.
# STEP@SECONDS runs a step under that limit instead of its own (each part of a step that has
# several, e.g. torch_peer's batches).
#
# Check a run's command lines on a CPU first, with a stand-in interpreter that parses each step's
# flags, configs and test selection without running them (tests/test_gpu_dry_run.py does this for
# the next GPU run below):
#
#   PY="python scripts/gpu/dry_python.py" OUT=/tmp/dry scripts/gpu/run.sh env train:dots:cudnn:4 ...
#
# The next GPU run: what the open issues still ask of a GPU, in order of worth, with limits
# that sum to 735 s (setup, a pip install of the checkout, is not limited: ~15 s):
#
#   TORCH_BATCHES=4 scripts/gpu/run.sh setup env@15 \
#     train:dots_attention:cudnn:4@60 train:dots:cudnn:4@60 torch_peer@100 \
#     fp8@50 decode_triton@30 attention_ws@40 quant_decode@130 \
#     random_1b@25 serve_1b@135 decode_hbm@50
#
# One command may run 600 s at most, so this is two: the first up to attention_ws (395 s of
# limits), the second `setup quant_decode@130 random_1b@25 serve_1b@135 decode_hbm@50` (340 s).
# With a machine's start (1-2 min) the two fill a 15-minute lease; when less is left, drop steps
# from the end of the list.
#
#   env 15: the device and the versions
#   issue 44, MFU >= 55% and >= 1.2x the PyTorch peer: train:dots_attention and train:dots
#     60 + 60 (dots_attention saves attention's output and logsumexp; dots was the best on
#     2026-11-26; a 1B step at seq 4096 took 30 s with its compile on 2026-11-24), torch_peer
#     100 (batch 4, torch.compile)
#   issue 44, fp8 50: bf16 against current, blockwise and delayed scaling at d 2048 and 4096
#   issue 44, the quantized decode kernel: decode_triton 30 (32k, batch 1 and 16)
#   issue 44, flash against cuDNN: attention_ws 40 + 40 (numerics, then 8k and 16k; the
#     warp-specialised forward with the two-kernel and with the fused backward)
#   issue 36, quant_decode 130: bf16, int8, int4, W8A8-fp8 and W8A8-int8 decode at batch 1
#     and 16 and a 2048-token prefill, the Llama-3.2-1B shape, random weights (15 compiles;
#     each kind's row is logged as it ends)
#   issue 38, random_1b 25 (the run serve_1b reads), serve_1b 135 (bench_serve, 16 clients,
#     64 requests, against the static generator; the server first compiles its 30 step
#     buckets), decode_hbm 50 (the bf16 decode step at batch 64, generate's and the engine's,
#     as a share of peak HBM bandwidth)
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site

step() {  # step NAME SECONDS COMMAND...: run with a limit ($CAP, from STEP@SECONDS, if set),
  # log to $OUT/NAME.log, report status
  local name=$1 limit=${CAP:-$2}
  shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/steps.log"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/steps.log"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

ATT_SEQS=${ATT_SEQS:-2048,4096,8192,16384}
RUN_1B=${RUN_1B:-/tmp/random-1b}  # the Llama-3.2-1B-shaped run of random weights serve_1b reads
for s in "$@"; do
  CAP=
  if [[ $s == *@* ]]; then
    CAP=${s##*@}
    s=${s%@*}
    [[ $CAP =~ ^[0-9]+$ ]] || { echo "step $s@$CAP: the limit must be whole seconds"; exit 2; }
  fi
  case $s in
    setup)
      if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
      fi
      $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/setup.log" 2>&1 \
        || { cat "$OUT/setup.log"; exit 1; } ;;
    env)
      step env 60 bash -c "nvidia-smi; $PY -c 'import jax, jaxlib, flax, optax, grain, jaxllm; \
print(jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__, grain.__version__); \
print(jax.devices(), jax.devices()[0].device_kind)'" ;;
    tests)
      step tests 300 $PY -m pytest -p no:cacheprovider -m gpu -n 0 -q --timeout 240 \
        -o addopts="" tests/test_gpu.py ;;
    probe)
      step probe 120 $PY scripts/gpu/cudnn_packed_probe.py 64 ;;
    attention)
      step attention 240 $PY scripts/bench_attention.py --impls flash,cudnn,xla --seqs "$ATT_SEQS" ;;
    attention_ws)  # the warp-specialised flash forward and the fused backward: numerics, then
      # vs cuDNN and the current kernels at 8k and 16k, head dim 128
      step attention_ws_tests 120 $PY -m pytest -p no:cacheprovider -m gpu -n 0 -q --timeout 80 \
        -o addopts="" tests/test_gpu.py -k "mgpu-ws or mgpu-fused"
      step attention_ws 120 $PY scripts/bench_attention.py \
        --impls flash_ws,flash_ws_fused,flash,cudnn --seqs 8192,16384 --iters 5 ;;
    attention_triton)
      step attention_triton 120 $PY scripts/bench_attention.py --impls flash --flash-backend triton \
        --seqs "$ATT_SEQS" ;;
    attention_d64)
      step attention_d64 150 $PY scripts/bench_attention.py --impls flash,cudnn,xla --head-dim 64 \
        --seqs 4096 ;;
    decode)
      step decode 150 $PY scripts/bench_decode.py --contexts 4096,32768,131072 --batch 1,16 ;;
    int4_matmul)  # the int4 weight-only matmul kernel vs a bf16 weight, Llama-3.2-1B shapes
      step int4_matmul 150 $PY scripts/bench_int4_matmul.py --batch 1,16 ;;
    fp8)  # one SwiGLU MLP layer's forward + backward at d 2048 and 4096: bf16 and each fp8 scaling
      step fp8 300 $PY scripts/bench_fp8.py --shapes 2048x8192,4096x14336 --tokens 8192 ;;
    decode_triton)
      step decode_triton 120 $PY scripts/bench_decode.py --contexts 32768 --batch 1,16 \
        --backend triton ;;
    attention_blocks)  # block sizes of both flash backends at seq 8k, head dim 128
      for bk in 64,64 64,128 128,64 128,128; do
        for be in mosaic_gpu triton; do
          step "blocks_${be}_${bk/,/x}" 60 $PY scripts/bench_attention.py --impls flash \
            --flash-backend $be --seqs 8192 --block-q ${bk%,*} --block-kv ${bk#*,}
        done
      done ;;
    decode_backends)  # each decode backend at 32k, batch 1 and 16
      for be in mosaic_gpu triton xla; do
        step "decode_$be" 90 $PY scripts/bench_decode.py --contexts 32768 --batch 1,16 --backend $be
      done ;;
    decode_sweep)  # the Triton decode kernel's kv block and split counts: 32k context, batch 16
      for bk in 32 64 128 256; do
        for ns in 4 16 64; do
          step "decode_bk${bk}_s${ns}" 90 $PY scripts/bench_decode.py --contexts 32768 --batch 16 \
            --backend triton --block-kv $bk --num-splits $ns --iters 10
        done
      done ;;
    train:*)  # train:REMAT[:IMPL[:BATCH]]: `jaxllm bench train` on the Llama-3.2-1B shape, seq
      # 4096; $EXTRA adds overrides (e.g. "train.loss_chunks=8"), $TAG names the log, and
      # XLA_PYTHON_CLIENT_MEM_FRACTION (default .75) how much of the GPU JAX takes
      IFS=: read -r _ remat impl batch <<<"$s"
      # shellcheck disable=SC2086
      step "train_${remat}_${impl:-auto}_b${batch:-4}${TAG:-}" 240 $PY -m jaxllm bench train \
        configs/models/llama3_2_1b.yaml data.seq_len=4096 train.global_batch_size=${batch:-4} \
        model.remat=$remat model.attention_impl=${impl:-auto} ${EXTRA:-} --steps 5 --warmup 2 \
        --no-compiled-flops ;;
    torch_peer)  # the PyTorch peer's train step on the same shape (Llama-3.2-1B, seq 4096,
      # batch 4 and 8, torch.compile): $TORCH_PEER is its script (a shared/ checkout's by default)
      for batch in ${TORCH_BATCHES:-4 8}; do
        step "torch_peer_b$batch" 300 $PY "${TORCH_PEER:-shared/tools/torch_llama_step.py}" \
          $batch 4096 --compile
      done ;;
    quant_decode)  # issue 36: bf16, int8, int4 (group 128), W8A8-fp8 and SmoothQuant W8A8-int8
      # decode at batch 1 and 16 and a 2048-token prefill, Llama-3.2-1B shape, random weights
      step quant_decode 240 $PY scripts/bench_quant_decode.py --model 1b --batch 1,16 \
        --new-tokens 256 --prefill-len 2048 --out "$OUT/quant_decode.json" ;;
    random_1b)  # a run directory of random weights in the Llama-3.2-1B shape at $RUN_1B
      rm -rf "$RUN_1B"
      step random_1b 120 $PY scripts/bench_quant_decode.py --model 1b --write-run "$RUN_1B" ;;
    serve_1b)  # issue 38: bench_serve on $RUN_1B (written first if missing), bf16 KV, against
      # the static generator (transformers' generate left out: its 1B decode takes minutes)
      [ -f "$RUN_1B/config.yaml" ] || step random_1b 120 $PY scripts/bench_quant_decode.py \
        --model 1b --write-run "$RUN_1B"
      step serve_1b 240 $PY scripts/bench_serve.py "$RUN_1B" --no-hf --clients 16 \
        --num-requests 64 --output-len 16:256 --page-size 64 --max-model-len 640 \
        --kv-cache-dtype bfloat16 --out "$OUT/serve_1b.json" ;;
    decode_hbm)  # issue 38: the bf16 decode step at batch 64 (520-token prompts), generate's
      # and the engine's, its weights + KV bytes per step as a share of peak HBM bandwidth
      step decode_hbm 120 $PY scripts/bench_quant_decode.py --model 1b --kinds bf16 --batch 64 \
        --prompt-len 520 --new-tokens 128 --prefill-len 0 --engine --engine-steps 32 \
        --out "$OUT/decode_hbm.json" ;;
    remat_count)  # model.remat=dots_attention: cuDNN attention forwards in the compiled step
      step remat_count 300 $PY scripts/gpu/remat_attention_count.py ;;
    comm)  # `jaxllm bench comm` on the machine's GPUs (a smoke test on one GPU)
      step comm 120 $PY -m jaxllm bench comm --max-bytes 256M --json "$OUT/comm.json" ;;
    deterministic)  # train.deterministic: two runs bit-identical (and two without it, compared)
      step deterministic 300 $PY scripts/gpu/deterministic_check.py 20 ;;
    deterministic_cost)  # its step time: the Llama-3.2-1B shape, seq 4096, with and without
      for det in false true; do
        step "deterministic_cost_$det" 240 $PY -m jaxllm bench train \
          configs/models/llama3_2_1b.yaml data.seq_len=4096 train.global_batch_size=4 \
          model.remat=full train.deterministic=$det --steps 5 --warmup 2 --no-compiled-flops
      done ;;
    profile)  # the best measured step, profiled: the device ops that take the time
      step profile 240 $PY -m jaxllm bench train configs/runs/llama3_2_1b_h100.yaml --steps 3 \
        --warmup 1 --no-compiled-flops --profile /tmp/jaxllm-trace ;;
    *)
      echo "unknown step $s"; exit 2 ;;
  esac
done
