"""Per-rank memory of the launcher's tiny CPU models next to the memory model's prediction.

For each setting (precision, distributed optimizer, recompute) this builds the trainer the
launcher builds (``megatron.skrull.pretrain_gpt.build_trainer``, one process), runs one
iteration, and measures:

* static bytes from the real tensors -- parameters, gradients, main parameters (optimizer
  copies that are not the model's tensors) and optimizer state -- counting each storage once
  (DDP buffers and views are not double counted);
* activation bytes per token: the peak bytes autograd holds for backward over the forward
  and backward of one micro-batch (``torch.autograd.graph.saved_tensors_hooks``, live
  storages, recomputed tensors included), divided by its tokens.

Next to them: :class:`skrull_ext.costmodel.memory.TrainingMemory`'s prediction (for the
activations its saved terms, with torch's composite RMSNorm of the CPU).  Two-process
settings (DP 2 for the distributed optimizer, TP 2 with and without sequence parallelism)
report rank 0.  Settings
whose flags the launcher does not accept are reported as skipped.

    PYTHONPATH=. python benchmarks/bench_memory.py [--json out.json]

With ``--device cuda`` (or ``cpu``) it compares instead the *peak* memory of whole training
iterations with the memory model, on the Qwen2.5-0.5B shape (``tiny`` on CPU) at three
buckets, with and without recompute, and trains the planner's recommended bucket for the
device's memory (:mod:`memory_allocator`; extra launcher flags may follow)::

    python benchmarks/bench_memory.py --device cuda --json mem.json --time-budget-s 90
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_io  # noqa: E402

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--swiglu",
        "--normalization", "RMSNorm",
        "--disable-bias-linear", "--seq-length", "96", "--global-batch-size", "6",
        "--lr", "3e-3", "--train-iters", "1", "--skrull-bucket-size", "512", "--device", "cpu",
        "--mock-num-samples", "64"]

# name, processes (data-parallel ranks), extra launcher flags, TrainingMemory fields
SETTINGS = [
    ("fp32", 1, [], dict(precision="fp32")),
    ("fp32, DP 2 + distributed optimizer", 2, ["--use-distributed-optimizer"],
     dict(precision="fp32", distributed_optimizer=True)),
    ("bf16, DP 2 + distributed optimizer", 2, ["--bf16", "--use-distributed-optimizer"],
     dict(precision="bf16", distributed_optimizer=True)),
    ("fp32 + full recompute", 1, ["--recompute-granularity", "full", "--recompute-method",
                                  "uniform", "--recompute-num-layers", "1"],
     dict(precision="fp32", recompute="full")),
    ("fp32 + selective recompute", 1, ["--recompute-granularity", "selective"],
     dict(precision="fp32", recompute="selective")),
    ("fp32, TP 2", 2, ["--tensor-model-parallel-size", "2"], dict(precision="fp32", tp_size=2)),
    ("fp32, TP 2 + sequence parallel", 2, ["--tensor-model-parallel-size", "2",
                                           "--sequence-parallel"],
     dict(precision="fp32", tp_size=2, sequence_parallel=True)),
]


def _storages(tensors) -> dict[int, int]:
    """``{storage pointer: bytes}`` of the given tensors (each storage once)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def _optimizer_parts(optimizer) -> tuple[list, list]:
    """(parameters the optimizer updates, its state tensors), mcore or torch optimizers."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    params, state = [], []
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", opt)
        for group in torch_opt.param_groups:
            params.extend(group["params"])
        for s in torch_opt.state.values():
            state.extend(v for v in s.values() if isinstance(v, torch.Tensor))
    return params, state


def measure_static(trainer) -> dict[str, int]:
    """Bytes per rank of params, grads, main params and optimizer state (real tensors)."""
    model_params = list(trainer.model.parameters())
    params = _storages(model_params)
    grads = _storages([getattr(p, "main_grad", None) if getattr(p, "main_grad", None)
                       is not None else p.grad for p in model_params])
    opt_params, opt_state = _optimizer_parts(trainer.optimizer)
    main = {k: v for k, v in _storages(opt_params).items() if k not in params}
    state = {k: v for k, v in _storages(opt_state).items()
             if k not in params and k not in main}
    return {"params": sum(params.values()), "grads": sum(grads.values()),
            "main_params": sum(main.values()), "optimizer_state": sum(state.values())}


class SavedTensorPeak:
    """Peak bytes autograd holds for backward (``saved_tensors_hooks``), live accounting.

    Every saved tensor is packed into a handle the autograd graph owns; the handle counts
    its storage while it lives (each storage once, however many tensors view it) and the
    graph drops it once backward has used it.  Activation recompute saves its layer inputs
    in forward and the recomputed layer's tensors during backward: both are counted, so
    ``peak`` is the most saved-for-backward memory alive at one time.

    Args:
        exclude: Storage pointers not to count (the parameters: saved, never allocated).
    """

    def __init__(self, exclude=()):
        self.exclude, self.live, self.refs = set(exclude), 0, {}
        self.peak = 0

    def _add(self, t: torch.Tensor) -> Optional[int]:
        if not t.numel():
            return None
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude:
            return None
        count, nbytes = self.refs.get(key, (0, storage.nbytes()))
        if count == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] = (count + 1, nbytes)
        return key

    def _drop(self, key: int) -> None:
        count, nbytes = self.refs[key]
        if count == 1:
            del self.refs[key]
            self.live -= nbytes
        else:
            self.refs[key] = (count - 1, nbytes)

    def hooks(self):
        tracker = self

        class Handle:
            def __init__(self, t):
                self.t, self.key = t, tracker._add(t)

            def __del__(self):
                if self.key is not None:
                    tracker._drop(self.key)

        return torch.autograd.graph.saved_tensors_hooks(Handle, lambda h: h.t)


def largest_micro_batch(trainer):
    """This rank's inputs of the next global batch's largest micro-batch."""
    from megatron.skrull.micro_batch import materialize

    ids, plan = trainer.next_plan()
    inputs = [materialize(trainer.source, ids, plan, mb, trainer.groups, trainer.device)
              for mb in plan.dp_ranks[trainer.groups.dp_rank]]
    return max((x for x in inputs if x is not None), key=lambda x: x.input_ids.shape[1])


def measure_activations(trainer) -> tuple[int, int]:
    """(peak saved-for-backward bytes of one micro-batch's forward + backward, its tokens).

    The micro-batch is the largest of the next global batch; forward and backward run as
    in training (the launcher's model, its recompute setting), under :class:`SavedTensorPeak`.
    """
    from megatron.skrull.cpu_compat import cuda_to_cpu
    from megatron.skrull.micro_batch import pad_micro_batch

    inputs = pad_micro_batch(largest_micro_batch(trainer), trainer.pad_multiple)
    tracker = SavedTensorPeak(_storages(trainer.model.parameters()))
    trainer.model.train()
    with cuda_to_cpu(trainer.device), tracker.hooks():
        losses = trainer.model(inputs.input_ids, inputs.position_ids, None,
                               labels=inputs.labels,
                               packed_seq_params=inputs.packed_seq_params)
        (losses * inputs.loss_mask).sum().backward()
    return tracker.peak, int(inputs.input_ids.shape[1])


def spec_of(cfg, vocab: int):
    from skrull_ext.costmodel.model import ModelSpec

    m = cfg.model
    return ModelSpec(name="tiny", num_layers=m.num_layers, hidden_size=m.hidden_size,
                     ffn_hidden_size=m.ffn_size,
                     num_attention_heads=m.num_attention_heads,
                     num_query_groups=m.num_query_groups or m.num_attention_heads,
                     vocab_size=vocab, swiglu=m.swiglu,
                     tied_embeddings=not m.untie_embeddings_and_output_weights)


def run_setting(flags: list[str], fields: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Measures one setting on this rank (the default process group's world is the DP
    size); ``None`` if the launcher rejects the flags."""
    from megatron.core import parallel_state
    from megatron.skrull.arguments import ConfigError, parse_args
    from megatron.skrull.cpu_compat import apply_cpu_compat
    from megatron.skrull.pretrain_gpt import build_trainer, init_distributed, init_model_parallel
    from skrull_ext.costmodel.activations import SAVED
    from skrull_ext.costmodel.memory import TrainingMemory, norm_for

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage text
            cfg = parse_args(TINY + flags, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, SystemExit):
        return None
    device = torch.device("cpu")
    apply_cpu_compat(device)
    init_distributed(device, init_method=os.environ.get("BENCH_INIT_METHOD"))
    parallel_state.destroy_model_parallel()
    init_model_parallel(cfg, device)
    trainer = build_trainer(cfg, device)
    trainer.train_step()  # gradients and optimizer state exist after one step
    static = measure_static(trainer)
    act, tokens = measure_activations(trainer)
    model = trainer.model
    while hasattr(model, "module"):  # mcore DDP / Float16Module
        model = model.module
    vocab = model.vocab_size
    mem = TrainingMemory(dp_cp_size=cfg.parallel.dp_size,
                         norm=norm_for(device.type, cfg.model.normalization), **fields)
    spec = spec_of(cfg, vocab)
    # The CPU meter sees saved tensors only: the model's saved terms, CPU's composite norm.
    alpha = mem.activation_bytes_per_token(spec, kinds=(SAVED,))
    return {"measured": {**static, "activation_bytes_per_token": act / tokens},
            "predicted": {**mem.static_breakdown(spec), "activation_bytes_per_token": alpha}}


def _rank_main(rank: int, world: int, store: str, out: str, flags, fields) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world),
                      BENCH_INIT_METHOD=f"file://{store}")
    torch.set_num_threads(1)
    result = run_setting(flags, fields)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def run_spawned(world: int, flags: list[str], fields: dict[str, Any]) -> Optional[dict]:
    """:func:`run_setting` on ``world`` fresh processes (gloo, file store); rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        torch.multiprocessing.spawn(_rank_main, nprocs=world, join=True,
                                    args=(world, os.path.join(tmp, "store"), out, flags, fields))
        with open(out) as f:
            return json.load(f)


def table(results: dict[str, Optional[dict]]) -> str:
    keys = ["params", "grads", "main_params", "optimizer_state", "activation_bytes_per_token"]
    lines = ["| setting | " + " | ".join(k.replace("_", " ") for k in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for name, r in results.items():
        if r is None:
            lines.append(f"| {name} | " + " | ".join(["(flags not accepted yet)"] * len(keys))
                         + " |")
            continue
        cells = [f"{r['measured'][k] / 1024:.1f} / {r['predicted'][k] / 1024:.1f}" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nKiB measured / predicted; activations: KiB per token."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    help="peak memory of training iterations on this device against the model")
    ap.add_argument("--shape", help="with --device: model shape (default qwen2.5-0.5b on cuda, "
                                    "tiny on cpu)")
    ap.add_argument("--buckets", type=int, nargs="+", help="with --device: buckets to fill")
    ap.add_argument("--device-memory-gb", type=float,
                    help="with --device: memory the planner sizes its bucket for (default: "
                         "the GPU's; 16 on cpu)")
    ap.add_argument("--settings", default="selective,none,full",
                    help="with --device: recompute settings to measure, in this order")
    ap.add_argument("--time-budget-s", type=float, default=90.0)
    args, launcher = ap.parse_known_args(argv)
    run = results_io.start()
    if args.device:
        from memory_allocator import main as allocator_main

        result = allocator_main(args, launcher)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        results_io.record(f"bench_memory_{args.device}", result, run, argv,
                          script="bench_memory")
        return 0
    if launcher:
        ap.error(f"unrecognized arguments: {' '.join(launcher)}")
    torch.set_num_threads(1)
    results = {name: run_spawned(world, flags, fields)
               for name, world, flags, fields in SETTINGS}
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    results_io.record("bench_memory", results, run, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
