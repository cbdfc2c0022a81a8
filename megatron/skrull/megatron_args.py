"""Every argument of Megatron-LM's training parser, in one of three kinds.

* **implemented**: :func:`megatron.skrull.flags.build_parser` defines it (derived by
  introspection, :func:`implemented_names`; never listed here);
* **accepted** (:data:`ACCEPTED`): parsed with Megatron-LM's own value kind and otherwise
  without effect; the launcher logs one line per reason naming what this stack does instead;
* **refused** (:data:`REFUSED`): ignoring it would silently change the results; giving it is
  one error line with the reason (exit 2).

The names and value kinds (``flag``, ``int``, ``str+``, ``{a,b}`` ...) are those of
``megatron_lm_arguments.txt`` next to this file, written by ``tools/dump_megatron_lm_args.py``
from Megatron-LM at :data:`MEGATRON_LM_COMMIT`; ``tests/test_megatron_args.py`` checks that
every name there falls in exactly one kind.  ``docs/megatron_flags.md`` is generated from
these tables (``python tools/megatron_flags_doc.py``).
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import Iterable

MEGATRON_LM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
ARGUMENTS_FILE = os.path.join(os.path.dirname(__file__), "megatron_lm_arguments.txt")
DEST_PREFIX = "megatron_lm__"  # namespace attributes of accepted/refused flags

_MOE = "only used with MoE (--num-experts, refused)"
_FP8 = "only used with fp8/fp4 training (--fp8-format / --fp4-format, refused)"

# (what this stack does instead, names).  One log line per row that a run uses.
ACCEPTED: tuple[tuple[str, str], ...] = (
    ("fusion and kernel switches: the layers compute the same math unfused on CPU and with "
     "the attention kernel of --skrull-attention-kernel on GPU",
     "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion "
     "--no-bias-dropout-fusion --cross-entropy-loss-fusion "
     "--cross-entropy-fusion-impl --no-gradient-accumulation-fusion --no-persist-layer-norm "
     "--disable-jit-fuser --fused-residual-rmsnorm --use-transformer-engine-op-fuser "
     "--use-te-activation-func --no-gradient-reduce-div-fusion --use-flash-attn "
     "--flash-attention-version --attention-softmax-in-fp32 --apply-query-key-layer-scaling "
     "--disable-bf16-reduced-precision-matmul --batch-invariant-mode --batch-invariant-backend "
     "--deterministic-mode --use-fused-weighted-squared-relu"),
    ("always on here: models are Megatron-Core GPTModels, loss is the sum of token losses "
     "over the global batch's loss tokens, each sample is its own document (positions "
     "restart, attention stays inside it)",
     "--use-mcore-models --calculate-per-token-loss --reset-position-ids "
     "--reset-attention-mask --dataloader-inter-document-masking "
     "--no-create-attention-mask-in-dataloader --sft --sft-tokenizer-prompt-format"),
    ("the layernorm weight is stored as gamma, not gamma - 1: with AdamW and no weight "
     "decay on norm weights (mcore's grouping) training is the same",
     "--apply-layernorm-1p"),
    ("data loading: samples are read from the preprocessed dataset and packed by the "
     "scheduler in the training process (tools/preprocess_sft.py tokenizes); a test split is "
     "held out, not evaluated",
     "--num-workers --dataloader-type --no-mmap-bin-files --data-cache-path "
     "--num-dataset-builder-threads --dataloader-fast-cache-load "
     "--dataloader-defer-npy-index-mmap --mid-level-dataset-surplus --object-storage-cache-path "
     "--per-dataset-sequences-path --allow-ambiguous-pad-tokens --no-data-sharding "
     "--test-data-path"),
    ("tokenizer files: the tokenizer recorded with the preprocessed dataset (its .json meta) "
     "gives the vocabulary and EOD; --tokenizer-type/--tokenizer-model are checked against it",
     "--vocab-file --merge-file --vocab-extra-ids --tokenizer-metadata "
     "--tokenizer-special-tokens --tiktoken-pattern --tiktoken-num-special-tokens "
     "--tokenizer-sentencepiece-legacy --no-tokenizer-sentencepiece-ignore-extra-whitespaces "
     "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces --tokenizer-hf-no-use-fast "
     "--tokenizer-hf-no-include-special-tokens --trust-remote-code --null-tokenizer-eod-id "
     "--null-tokenizer-pad-id --chat-template --use-gigatoken"),
    ("memory housekeeping and checks: Python's garbage collector and PyTorch's caching "
     "allocator run with their defaults",
     "--manual-gc --manual-gc-interval --no-manual-gc-eval --disable-manual-gc-eval "
     "--empty-unused-memory-level --check-weight-hash-across-dp-replicas-interval "
     "--gpu-sniff-test-interval --train-sync-interval --no-check-for-nan-in-loss-and-grad "
     "--check-for-large-grads --result-rejected-tracker-filename --rerun-mode "
     "--check-for-spiky-loss --error-injection-rate --error-injection-type "
     "--no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding "
     "--init-model-with-meta-device --use-cpu-initialization --no-initialization "
     "--te-rng-tracker --inference-rng-tracker --onnx-safe"),
    ("communication tuning: the DACP ring does CP's communication and mcore's DDP the "
     "gradient reduction, with their defaults (same results)",
     "--tp-comm-overlap --tp-comm-overlap-cfg --no-tp-comm-bulk-wgrad "
     "--disable-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-dgrad "
     "--no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag --no-tp-comm-overlap-rs "
     "--disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag "
     "--disable-tp-comm-split-ag --no-tp-comm-split-rs --disable-tp-comm-split-rs "
     "--tp-comm-bootstrap-backend --delay-wgrad-compute --use-ring-exchange-p2p "
     "--defer-embedding-wgrad-compute --wgrad-deferral-limit "
     "--overlap-p2p-communication-warmup-flush --no-overlap-p2p-communication "
     "--pipeline-model-parallel-comm-backend --hierarchical-context-parallel-sizes "
     "--cp-comm-type --ddp-num-buckets --ddp-bucket-size --ddp-pad-buckets-for-high-nccl-busbw "
     "--ddp-reduce-scatter-with-fp32-accumulation --ddp-average-in-collective "
     "--ddp-param-name-patterns-for-fp32-local-accumulation --no-align-grad-reduce "
     "--disable-align-grad-reduce --no-align-param-gather "
     "--overlap-param-gather-with-optimizer-step --use-nccl-ub --disable-symmetric-registration "
     "--nccl-communicator-config-path --use-sharp --sharp-enabled-group "
     "--high-priority-stream-groups --create-all-gather-group --use-tp-pp-dp-mapping "
     "--distributed-backend --local-rank --lazy-mpu-init --disable-gloo-process-groups "
     "--distributed-timeout-seconds-after-init --tensor-parallel-num-weight-shards "
     "--gtp-remat-opt-in-modules --gtp-remat-reduce-scatter-with-fp32-accumulation "
     "--gtp-remat-nccl-ub --gtp-expert-remat-nccl-ub --flight-recorder-dump-path "
     "--flight-recorder-trace-buffer-size --no-flight-recorder-dump-on-timeout "
     "--disable-flight-recorder-dump-on-timeout --flight-recorder-include-stack-trace "
     "--no-flight-recorder-include-only-active --disable-flight-recorder-include-only-active "
     "--no-flight-recorder-extra-dump-on-exec --disable-flight-recorder-extra-dump-on-exec "
     "--accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16"),
    ("pipeline split: layers are split evenly over --pipeline-model-parallel-size (the "
     "schedule's math is the same; only memory and speed differ)",
     "--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers "
     "--pipeline-model-parallel-layout --account-for-embedding-in-pipeline-split "
     "--account-for-loss-in-pipeline-split --microbatch-group-size-per-virtual-pipeline-stage"),
    ("FSDP: parameters stay replicated over DP; --use-distributed-optimizer shards the "
     "optimizer state (same math)",
     "--use-megatron-fsdp --use-torch-fsdp2 --megatron-fsdp-version "
     "--no-use-layer-wise-param-layout --fsdp-manual-registration "
     "--data-parallel-sharding-strategy --outer-dp-sharding-strategy --fsdp-double-buffer "
     "--suggested-communication-unit-size --keep-fp8-transpose-cache "
     "--enable-full-sharding-in-hsdp --num-distributed-optimizer-instances "
     "--torch-fsdp2-no-reshard-after-forward --megatron-fsdp-main-params-dtype "
     "--megatron-fsdp-main-grads-dtype --megatron-fsdp-grad-comm-dtype "
     "--megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-max-pool-double-buffer "
     "--fsdp-db-use-persist-buf-on-alloc-fail"),
    ("offloading and recompute tuning: activations and optimizer state stay on the device; "
     "recompute is --recompute-granularity/--recompute-method",
     "--cpu-offloading-num-layers --cpu-offloading-retain-pinned-cpu-buffers "
     "--fine-grained-activation-offloading --offload-modules --min-offloaded-tensor-size "
     "--delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks "
     "--activation-offload-fraction --fine-grained-offloading-max-inflight-offloads "
     "--optimizer-cpu-offload --optimizer-offload-fraction --use-torch-optimizer-for-cpu-offload "
     "--overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads --no-pin-cpu-params "
     "--recompute-activations --checkpoint-activations --distribute-saved-activations "
     "--recompute-modules --mlp-chunks-for-training"),
    ("CUDA graphs: not captured (packed micro-batches change shape every step)",
     "--enable-cuda-graph --cuda-graph-warmup-steps --external-cuda-graph --cuda-graph-impl "
     "--cuda-graph-scope --cuda-graph-modules --optimizer-cuda-graph"),
    ("logging, profiling and telemetry: the log line, TensorBoard (--tensorboard-dir) and "
     "wandb (--wandb-project) show what this stack measures",
     "--log-params-norm --log-progress --timing-log-level --timing-log-option "
     "--tensorboard-log-interval --tensorboard-queue-size --no-log-loss-scale-to-tensorboard "
     "--disable-log-loss-scale-to-tensorboard --log-memory-to-tensorboard --log-memory-interval "
     "--log-device-memory-used --log-num-zeros-in-grad --log-max-attention-logit "
     "--no-barrier-with-level-1-timing --log-world-size-to-tensorboard --logging-level "
     "--log-energy --profile --profile-step-start --profile-step-end --use-pytorch-profiler "
     "--pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack "
     "--pytorch-profiler-collect-chakra --profile-ranks --record-memory-history "
     "--memory-snapshot-path --record-shapes --nvtx-ranges --config-logger-dir "
     "--dump-param-to-param-group-map --log-straggler --straggler-ctrlr-port "
     "--straggler-minmax-count --disable-straggler-on-startup --run-workload-inspector-server "
     "--no-one-logger --one-logger-project --one-logger-run-name --one-logger-async "
     "--app-tag-run-name --app-tag-run-version --otel-enabled --otel-service-name "
     "--otel-span-groups"),
    ("checkpoint I/O: torch_dist checkpoints are written synchronously and fully "
     "reshardable; a missing --load directory is always an error",
     "--async-save --async-strategy --use-persistent-ckpt-worker --async-ckpt-cpu-priority "
     "--async-ckpt-io-priority --async-ckpt-use-cpu-shm --ckpt-fully-parallel-load "
     "--ckpt-fully-parallel-load-exchange-algo --ckpt-fully-parallel-load-per-rank-objects "
     "--ckpt-fully-parallel-save-process-group --ckpt-fully-parallel-load-process-group "
     "--ckpt-fully-parallel-save --no-ckpt-fully-parallel-save --ckpt-assume-constant-structure "
     "--ckpt-pg-tensors-cache-path --ckpt-pg-tensors-cache-create "
     "--no-ckpt-load-validate-sharding-integrity "
     "--disable-ckpt-load-validate-sharding-integrity --no-strict-fsdp-dtensor-load "
     "--disable-strict-fsdp-dtensor-load --dist-ckpt-strictness --dist-ckpt-save-pre-mcore-014 "
     "--dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient "
     "--no-save-tokenizer-assets --disable-save-tokenizer-assets --use-dist-ckpt "
     "--dist-ckpt-format --dist-ckpt-workers --ckpt-drop-redundant-extra-state "
     "--auto-detect-ckpt-format --exit-on-missing-checkpoint --non-persistent-save-interval "
     "--non-persistent-ckpt-type --non-persistent-global-ckpt-dir --non-persistent-local-ckpt-dir "
     "--non-persistent-local-ckpt-algo --save-retain-interval --replication --replication-jump "
     "--replication-factor --verify-integrity --save-params-interval --save-activations-interval "
     "--save-tokens-per-expert-interval --save-wgrads-interval --save-dgrads-interval "
     "--use-checkpoint-args --use-mp-args-from-checkpoint-args "
     "--no-use-tokenizer-model-from-checkpoint-args "
     "--disable-use-tokenizer-model-from-checkpoint-args --load-main-params-from-ckpt"),
    ("fault tolerance and restarts: a run resumes from its last checkpoint "
     "(--save/--load, --exit-signal-handler)",
     "--adlr-autoresume --adlr-autoresume-interval --enable-ft-package --calc-ft-timeouts "
     "--ft-num-warmup-iters --inprocess-restart --inprocess-max-iterations "
     "--inprocess-monitor-thread-interval --inprocess-monitor-process-interval "
     "--inprocess-progress-watchdog-interval --inprocess-heartbeat-interval "
     "--inprocess-soft-timeout --inprocess-hard-timeout --inprocess-heartbeat-timeout "
     "--inprocess-barrier-timeout --inprocess-completion-timeout --inprocess-last-call-wait "
     "--inprocess-termination-grace-time --inprocess-granularity --inprocess-active-world-size "
     "--inprocess-empty-cuda-cache --fault-injector-ranks --fault-injector-num-ranks "
     "--fault-injector-fault-types --fault-injector-fault-probabilities "
     "--fault-injector-fault-delay --fault-injector-delay-start-iteration "
     "--fault-injector-mtti-seconds --fault-injector-offset-seconds --fault-injector-seed "
     "--exit-signal-handler-for-dataloader --exit-signal-handler-for-training "
     "--enable-msc --disable-msc --enable-experimental"),
    ("not used by GPT training (inference, serving, RL rollouts, BERT/T5, vision, retrieval, "
     "logit export)",
     "--inference-batch-times-seqlen-threshold --max-tokens-to-oom --output-bert-embeddings "
     "--bert-embedder-type --use-legacy-static-engine --inference-max-requests "
     "--inference-max-seq-length --inference-dynamic-batching "
     "--inference-dynamic-batching-buffer-size-gb "
     "--inference-dynamic-batching-paused-buffer-size-gb "
     "--inference-dynamic-batching-mamba-memory-ratio --inference-dynamic-batching-block-size "
     "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens "
     "--inference-dynamic-batching-num-cuda-graphs "
     "--inference-dynamic-batching-track-paused-request-events "
     "--inference-dynamic-batching-track-generated-token-events --decode-only-cuda-graphs "
     "--inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens "
     "--inference-dynamic-batching-unified-memory-level --enable-chunked-prefill "
     "--num-speculative-tokens --inference-dynamic-batching-prefix-caching "
     "--no-inference-dynamic-batching-prefix-caching "
     "--inference-dynamic-batching-prefix-caching-eviction-policy "
     "--inference-dynamic-batching-prefix-caching-coordinator-policy "
     "--inference-dynamic-batching-prefix-caching-routing-alpha "
     "--inference-dynamic-batching-prefix-caching-mamba-gb "
     "--inference-dynamic-batching-cuda-graph-mixed-prefill-count "
     "--inference-dynamic-batching-cuda-graph-sizing-distribution "
     "--inference-dynamic-batching-sampling-backend --use-same-sampling-seed-across-dp-ranks "
     "--inference-dynamic-batching-async-sched-mode --inference-dynamic-batching-logprobs-mode "
     "--inference-logging-step-interval --inference-text-gen-server-logging "
     "--no-inference-text-gen-server-logging --inference-wandb-logging "
     "--no-inference-wandb-logging --inference-coordinator-port "
     "--mamba-inference-conv-states-dtype --mamba-inference-ssm-states-dtype "
     "--inference-use-synchronous-zmq-collectives "
     "--no-inference-use-synchronous-zmq-collectives --inference-disable-ep-consensus "
     "--no-inference-disable-ep-consensus --inference-shards --inference-cuda-graph-scope "
     "--flash-decode --symmetric-ar-type --nccl-all-reduce-for-prefill "
     "--inference-fuse-tp-communication --inference-disable-triton-nvls-kernels "
     "--inference-grouped-gemm-backend --inference-moe-disable-fused-quant-kernels "
     "--inference-moe-token-dispatcher-type --mlp-chunks-for-prefill "
     "--rl-prompts-per-eval --grpo-prompts-per-step --grpo-group-size --rl-generation-lag "
     "--rl-max-inflight-requests --rl-submission-granularity --rl-consumption-granularity "
     "--rl-durable-rollout-bank --rl-rollout-bank-dir --rl-rollout-bank-max-bytes "
     "--grpo-iterations --grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-kl-beta "
     "--grpo-entropy-term-weight --grpo-filter-groups-with-same-reward --langrl-env-config "
     "--rl-default-temperature --rl-default-top-p --rl-default-top-k "
     "--rl-offload-optimizer-during-inference --rl-kv-cache-management-mode "
     "--rl-persist-cuda-graphs --no-rl-persist-cuda-graphs --rl-partial-rollouts "
     "--no-rl-partial-rollouts --rl-inference-logprobs-is-correction "
     "--no-rl-inference-logprobs-is-correction --rl-importance-sampling-truncation-coef "
     "--rl-use-sequence-packing --no-rl-use-sequence-packing "
     "--rl-sequence-packing-max-sequences-per-bin --rl-sequence-packing-algo "
     "--rl-training-cuda-graphs --no-rl-training-cuda-graphs "
     "--rl-inference-tensor-model-parallel-size --rl-inference-pipeline-model-parallel-size "
     "--rl-inference-expert-model-parallel-size "
     "--rl-inference-expert-tensor-model-parallel-size "
     "--rl-inference-model-unified-memory-level --rl-offload-inference-model-weights-when-idle "
     "--no-rl-offload-inference-model-weights-when-idle --refit-method "
     "--rl-verify-model-weights-swap --no-rl-verify-model-weights-swap --rl-skip-bos-token "
     "--no-rl-skip-bos-token --rl-profile --rl-profile-dir --rl-inference-parsers "
     "--sample-rate --mask-prob --short-seq-prob --bert-no-binary-head --decoder-seq-length "
     "--decoder-num-layers --ict-head-size --biencoder-projection-dim "
     "--biencoder-shared-query-context-model --ict-load --bert-load --titles-data-path "
     "--query-in-block-prob --use-one-sent-docs --evidence-data-path "
     "--retriever-report-topk-accuracies --retriever-score-scaling --block-data-path "
     "--embedding-path --indexer-batch-size --indexer-log-interval --num-classes --img-h "
     "--img-w --num-channels --patch-dim --classes-fraction --data-per-class-fraction "
     "--head-lr-mult --vision-pretraining --vision-pretraining-type --vision-backbone-type "
     "--swin-backbone-type --mask-type --mask-factor --iter-per-epoch --dino-local-img-size "
     "--dino-local-crops-number --dino-head-hidden-size --dino-bottleneck-size "
     "--dino-freeze-last-layer --dino-norm-last-layer --dino-warmup-teacher-temp "
     "--dino-teacher-temp --dino-warmup-teacher-temp-epochs --logits-save-top-k "
     "--logits-save-top-p --logits-save-top-p-min-k --logits-save-dir --logits-save-dtype "
     "--logits-load-decode-threads --logits-load-prefetch-factor "
     "--logits-load-msc-prefetch-depth --logits-load-kd-loss-alpha --logits-load-ignore-errors "
     "--eval-micro-batch-size --mamba-training-ssm-states-dtype"),
    (_MOE + "; MoE parallel sizes other than 1 are meaningless for a dense model",
     "--expert-model-parallel-size --expert-tensor-parallel-size "
     "--expert-tensor-parallel-num-weight-shards --overlap-moe-expert-parallel-comm "
     "--overlap-dispatch-backward-with-experts-wgrad --ep-overlap-early-attn-memory-release "
     "--high-priority-a2a-comm-stream --moe-shared-expert-intermediate-size "
     "--moe-shared-expert-gate --moe-shared-expert-overlap --use-grouped-gemm-for-shared-expert "
     "--moe-shared-expert-glu-interleave-size --moe-ffn-hidden-size --moe-router-topk "
     "--moe-enable-routing-replay --moe-router-padding-for-quantization "
     "--moe-router-padding-for-fp8 --moe-router-num-groups --moe-router-group-topk "
     "--moe-router-pre-softmax --moe-router-topk-scaling-factor --moe-router-score-function "
     "--moe-router-dtype --moe-router-enable-expert-bias --moe-router-bias-update-rate "
     "--moe-router-quantile-balancing-ema --moe-router-force-load-balancing "
     "--moe-router-force-biased --use-grouped-gemm-for-dense-mlp --moe-grouped-gemm "
     "--moe-use-grouped-tensor --moe-single-grouped-weight --moe-single-grouped-bias "
     "--moe-z-loss-coeff --moe-input-jitter-eps --moe-token-dispatcher-type --moe-enable-deepep "
     "--moe-flex-dispatcher-backend --moe-permute-fusion-into-hybridep "
     "--moe-hybridep-pad-uneven-dispatch-inputs --moe-per-layer-logging "
     "--moe-expert-capacity-factor --moe-pad-expert-input-to-capacity "
     "--moe-pad-experts-for-cuda-graph-inference --moe-token-drop-policy --moe-layer-recompute "
     "--moe-permute-fusion --moe-router-fusion --moe-apply-probs-on-input --moe-latent-size "
     "--moe-flex-dispatcher-num-sms --moe-deepep-num-sms --moe-hybridep-num-sms "
     "--moe-hybridep-num-blocks-permute --moe-hybridep-num-blocks-unpermute "
     "--moe-hybridep-num-sms-preprocessing --moe-ncclep-zero-copy --moe-dispatch-fwd-dtype "
     "--moe-combine-bwd-dtype --moe-mlp-glu-interleave-size --moe-expert-rank-capacity-factor "
     "--moe-paged-stash --moe-paged-stash-page-size --moe-paged-stash-buffer-size-factor-cuda "
     "--moe-paged-stash-buffer-size-factor-cpu --moe-layer-freq --moe-router-load-balancing-type "
     "--moe-aux-loss-coeff --moe-upcycling-granularity --moe-routing-trace-path "
     "--moe-routing-trace-max-training-iters --moe-routing-trace-capture-logits "
     "--moe-routing-trace-capture-hidden-states --moe-routing-trace-dump-weights"),
    (_FP8, "--fp8-recipe --fp8-quantizer-factory --fp8-margin --fp8-interval "
     "--fp8-amax-history-len --fp8-amax-compute-algo --no-fp8-wgrad --disable-fp8-wgrad "
     "--fp8-output-proj --first-last-layers-bf16 --num-layers-at-start-in-bf16 "
     "--num-layers-at-end-in-bf16 --fp4-recipe --fp4-quantizer-factory --fp8-param-gather "
     "--fp4-param-gather --reuse-grad-buf-for-mxfp8-param-ag --te-precision-config-file"),
    ("only used with an architecture switch this stack refuses (multi-latent or linear "
     "attention, Mamba, MTP, muP, mHC, qk-clip, relative or mrope positions, sliding windows, "
     "kitchen)",
     "--q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim "
     "--rope-type --cache-mla-latents --mla-down-proj-fusion "
     "--dsa-indexer-n-heads --dsa-indexer-head-dim --dsa-indexer-topk --dsa-indexer-topk-freq "
     "--dsa-indexer-skip-topk-offset --dsa-indexer-loss-coeff --dsa-indexer-use-sparse-loss "
     "--dsa-kernel-backend --dsa-indexer-rope-interleaved --no-dsa-indexer-rotate-activation "
     "--disable-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu "
     "--disable-dsa-indexer-scoring-relu --dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 "
     "--linear-conv-kernel-dim --linear-key-head-dim --linear-value-head-dim "
     "--linear-num-key-heads --linear-num-value-heads --linear-attention-freq "
     "--mamba-state-dim --mamba-head-dim --mamba-num-groups --mamba-num-heads "
     "--gdp-num-householder --disable-mamba-mem-eff-path --gdp-cutedsl-kernel "
     "--gdp-num-chunk-states-to-recompute --mtp-loss-scaling-factor --mtp-use-repeated-layer "
     "--mtp-detach-heads --mtp-hsm --mtp-hybrid-override-pattern --mtp-standalone "
     "--mup-width-mult --mup-base-hidden-size --mup-embedding-mult --mup-output-mult "
     "--mup-base-head-dim --mup-attn-scale-power --mhc-num-residual-streams "
     "--mhc-sinkhorn-iterations --mhc-init-gating-factor --mhc-recompute-layer-num "
     "--qk-clip-alpha --qk-clip-threshold --relative-attention-num-buckets "
     "--relative-attention-max-distance --mrope-section --window-attn-skip-freq "
     "--kitchen-attention-backend"),
    ("only used with an optimizer other than Adam (--optimizer adam is the one implemented), "
     "the precision-aware optimizer or the WSD schedule (refused)",
     "--sgd-momentum --muon-momentum --muon-no-split-qkv --muon-nesterov --muon-scale-mode "
     "--muon-fp32-matmul-prec --muon-coefficient-type --muon-num-ns-steps --muon-tp-mode "
     "--muon-use-syrk --muon-extra-scale-factor --muon-scalar-optimizer --lion-beta1 "
     "--lion-beta2 --main-grads-dtype --main-params-dtype --exp-avg-dtype --exp-avg-sq-dtype "
     "--lr-wsd-decay-style --lr-wsd-decay-iters --lr-wsd-decay-samples"),
    ("only used with --fim-data (refused)",
     "--fim-rate --fim-spm-rate --fim-split-sample --fim-fragment-rate --fim-no-prefix "
     "--fim-prefix-token --fim-middle-token --fim-suffix-token --fim-pad-token --fim-eod-token"),
    ("the scheduler plans a global batch of any size (no multiple of --micro-batch-size x DP "
     "is needed), so no batch is decreased; with --step-batch-size-schedule it is an error, "
     "as in Megatron-LM",
     "--decrease-batch-size-if-needed"),
)

# (why it is refused and what to do instead, names).
REFUSED: tuple[tuple[str, str], ...] = (
    ("mixture of experts is not supported (dense GPT only); drop the flag",
     "--num-experts --moe-use-upcycling"),
    ("fp8/fp4 training needs Transformer Engine's low-precision GEMMs, which this stack does "
     "not run (the run would silently be bf16); drop the flag to train in bf16",
     "--fp8-format --fp4-format"),
    ("this architecture feature is not in this stack's GPT (dense, pre-norm, RoPE rotating "
     "halves, GeLU/SwiGLU); drop the flag or train it with Megatron-LM",
     "--multi-latent-attention --experimental-attention-variant --is-hybrid-model "
     "--hybrid-layer-pattern --hybrid-override-pattern --mtp-num-layers --use-mup "
     "--enable-mhc-connections --window-size --softmax-type --attention-output-gate "
     "--qk-l2-norm --qk-clip --glu-linear-offset --activation-func-clamp-value --openai-gelu "
     "--squared-relu --quick-geglu --apply-residual-connection-post-layernorm "
     "--fp32-residual-connection --rotary-interleaved --heterogeneous-layers-config-path "
     "--heterogeneous-layers-config-encoded-json --spec --yaml-cfg --use-kitchen-attention "
     "--output-logit-dtype"),
    ("this initialisation is not supported (--init-method-std and one seed for every rank "
     "are); drop the flag",
     "--embedding-init-method-std --init-method-xavier-uniform --data-parallel-random-init"),
    ("the optimizer and its schedule here are AdamW with a constant --weight-decay and "
     "warmup from 0; drop the flag (or set the equivalent one)",
     "--use-precision-aware-optimizer --lr-warmup-init --start-weight-decay "
     "--end-weight-decay --weight-decay-incr-style --apply-wd-to-qk-layernorm "
     "--no-weight-decay-cond-type --freeze-all-layers --min-loss-scale --loss-scale-window "
     "--hysteresis --fp16-lm-cross-entropy"),
    ("a Megatron-LM spelling this stack does not take: use the flag named in the reason",
     "--batch-size --warmup --encoder-seq-length --encoder-num-layers --model-parallel-size"),
    ("the interleaved pipeline schedule is not supported with Skrull; drop the flag "
     "(non-interleaved 1F1B is used)",
     "--num-virtual-stages-per-pipeline-rank"),
    ("this changes which data trains or is validated, or when training stops, which this "
     "stack does not support; drop the flag (--exit-interval stops at an iteration)",
     "--iterations-to-skip --phase-transition-iterations --fim-data --skip-train --test-mode "
     "--full-validation --multiple-validation-sets --validation-set-names "
     "--eval-global-batch-size --start-eval-at-iter"),
    ("the vocabulary is padded to a multiple of --make-vocab-size-divisible-by x TP (or to "
     "--padded-vocab-size); drop the flag (--make-vocab-size-divisible-by 1 pads nothing at "
     "TP 1)",
     "--no-pad-vocab-size --disable-pad-vocab-size"),
    ("checkpoint selection and conversion are not supported: --load DIR resumes its latest "
     "checkpoint (--finetune: weights only; --pretrained-hf: a Hugging Face model)",
     "--pretrained-checkpoint --ckpt-step --override-ckpt-iteration --ckpt-convert-format "
     "--ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format"),
    ("not a supervised training run (RL, distillation from saved logits, fake process "
     "groups); drop the flag",
     "--perform-rl-step --logits-load-dir --fake-process-group"),
)

# Which flag to use instead, for REFUSED's "Megatron-LM spelling" row.
SPELLINGS = {"--batch-size": "--micro-batch-size", "--warmup": "--lr-warmup-iters",
             "--encoder-seq-length": "--seq-length", "--encoder-num-layers": "--num-layers",
             "--model-parallel-size": "--tensor-model-parallel-size"}


def _names(text: str) -> list[str]:
    return text.split()


@functools.lru_cache(maxsize=1)
def megatron_kinds() -> dict[str, str]:
    """``{--name: kind}`` of every Megatron-LM argument (``megatron_lm_arguments.txt``)."""
    kinds = {}
    with open(ARGUMENTS_FILE) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, kind = line.rstrip("\n").split("\t")
                kinds[name] = kind
    return kinds


def classified() -> dict[str, tuple[str, str]]:
    """``{--name: (kind, reason)}`` for every accepted and refused name."""
    table = {}
    for kind, rows in (("accepted", ACCEPTED), ("refused", REFUSED)):
        for reason, names in rows:
            for name in _names(names):
                table[name] = (kind, reason)
    return table


def parse_kind(kind: str) -> dict:
    """argparse keywords for a value kind of ``megatron_lm_arguments.txt``."""
    if kind == "flag":
        return {"action": "store_true"}
    choices = None
    if "{" in kind:
        kind, rest = kind.split("{", 1)
        choices = rest.rstrip("}").split(",")
    base = next(t for t in ("int", "float", "str") if kind.startswith(t))
    nargs = kind[len(base):] or None
    kwargs: dict = {"type": {"int": int, "float": float, "str": str}[base]}
    if nargs:
        kwargs["nargs"] = int(nargs) if nargs.isdigit() else nargs
    if choices:
        kwargs["choices"] = [kwargs["type"](c) for c in choices]
    return kwargs


def dest(name: str) -> str:
    return DEST_PREFIX + name[2:].replace("-", "_")


@functools.lru_cache(maxsize=1)
def _flag_specs() -> tuple[tuple[str, dict], ...]:
    """``(name, argparse keywords)`` of every accepted and refused name, sorted."""
    kinds = megatron_kinds()
    return tuple((name, parse_kind(kinds[name])) for name in sorted(classified()))


def add_megatron_flags(ap: argparse.ArgumentParser) -> None:
    """Registers every accepted and refused name with Megatron-LM's value kind.

    Hidden from ``--help`` (docs/megatron_flags.md lists them); a name the parser already
    defines (implemented, or added by another module) is left alone.  Absent from the
    namespace unless given (``argparse.SUPPRESS``).  The actions are built from argparse's
    action registry and added directly: ``add_argument`` formats a help entry per flag to
    validate it (~0.2 ms each, 0.14 s for these ~780 fixed, already-checked flags).
    """
    known = set(ap._option_string_actions)
    for name, kwargs in _flag_specs():
        if name not in known:
            kwargs = dict(kwargs)
            action = ap._registry_get("action", kwargs.pop("action", None), None)
            ap._add_action(action(option_strings=[name], dest=dest(name),
                                  default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs))


def implemented_names(parser: argparse.ArgumentParser) -> set[str]:
    """Option strings ``parser`` (the launcher's) defines itself, not accepted/refused ones."""
    return {opt for action in parser._actions if not action.dest.startswith(DEST_PREFIX)
            for opt in action.option_strings}


def given(ns: argparse.Namespace) -> list[str]:
    """Accepted/refused names present in a parsed namespace, in table order."""
    table = classified()
    present = {k for k in vars(ns) if k.startswith(DEST_PREFIX)}
    return [n for n in table if dest(n) in present]


def problems_and_notes(ns: argparse.Namespace) -> tuple[list[str], list[str]]:
    """``(one error line per refused flag, one note line per accepted reason)``."""
    table, problems, notes = classified(), [], {}
    for name in given(ns):
        kind, reason = table[name]
        if kind == "refused":
            fix = f" (use {SPELLINGS[name]})" if name in SPELLINGS else ""
            problems.append(f"{name}: {reason}{fix}")
        else:
            notes.setdefault(reason, []).append(name)
    lines = [f"accepted Megatron-LM flag{'s' if len(n) > 1 else ''} {', '.join(n)}: {r}"
             for r, n in notes.items()]
    return problems, lines


def markdown(implemented: Iterable[str]) -> str:
    """docs/megatron_flags.md: every Megatron-LM argument by kind, one row per reason."""
    kinds = megatron_kinds()
    impl = sorted(n for n in implemented if n in kinds)
    out = ["# Megatron-LM flags: implemented, accepted, refused", "",
           "Generated by `python tools/megatron_flags_doc.py` from "
           "`megatron/skrull/megatron_args.py` (tests/test_megatron_args.py checks it is "
           f"current). Megatron-LM commit `{MEGATRON_LM_COMMIT[:12]}`, "
           f"{len(kinds)} argument names. Flag meanings: docs/training.md.", "",
           "* **implemented**: this stack does what Megatron-LM does with it;",
           "* **accepted**: parsed (Megatron-LM's value kinds) with no effect; the launcher "
           "logs one line naming what it does instead;",
           "* **refused**: ignoring it would change the results; one error line, exit 2.", "",
           f"## Implemented ({len(impl)})", "", " ".join(f"`{n}`" for n in impl), ""]
    for title, rows in (("Accepted", ACCEPTED), ("Refused", REFUSED)):
        count = sum(len(_names(n)) for _, n in rows)
        out += [f"## {title} ({count})", "", "| what this stack does | flags |", "| --- | --- |"]
        out += [f"| {reason} | {' '.join(f'`{n}`' for n in _names(names))} |"
                for reason, names in rows]
        out.append("")
    return "\n".join(out)

