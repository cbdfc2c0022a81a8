"""What autograd keeps for backward, tensor by tensor, next to the memory model's terms.

Builds the launcher's model in this process (``gpu_common.start_run``), runs one forward
pass of a micro-batch filled to ``--tokens`` (documents of the mock data, longest first)
under a census of the module scope each saved tensor was saved in
(``saved_tensors_hooks``), then walks the autograd graph from the loss: every node's
``_saved_*`` tensors, and for custom Functions (DACP attention, mcore's linear layers,
cross entropy, checkpoints) ``saved_tensors`` and tensor attributes of ``ctx``.  Each
storage is counted once, whole (a saved view keeps its base alive), parameters excluded.
It prints bytes per token by scope (one layer, averaged over the layers, and outside the
layers), node type and dtype, the totals against
:class:`skrull_ext.costmodel.memory.TrainingMemory`'s terms (``saved`` kind; per layer and
outside), and the peak over forward and backward: on CUDA the allocator's
(``max_memory_allocated`` above what was allocated before the forward, all kinds of
terms), on CPU the live saved tensors' (``bench_memory.SavedTensorPeak``, saved terms).

    python benchmarks/memory_breakdown.py --device cpu --shape qwen2.5-0.5b --num-layers 2 \\
        --tokens 1024 --recompute none,selective,full
    python benchmarks/memory_breakdown.py --device cuda --tokens 16384 --json breakdown.json

On CPU ``--bf16`` is added unless a precision is given (the GPU's dtypes), and torch's
RMSNorm is its composite (fp32 copies, ``norm="composite"`` in the model); the rest of
the graph is the one CUDA runs, the attention kernel aside (its tensors are saved by
our DACP function either way).  Extra arguments are launcher flags.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_common as gc_  # noqa: E402
import results_io  # noqa: E402
from memory_allocator import SETTINGS  # noqa: E402

RECOMPUTE = {key: flags for key, (_, flags) in SETTINGS.items()}  # bench_memory's --settings


SHARED = "(shared by the layers)"  # the scope of a storage saved in several layers


def _layer_of(scope: str) -> Optional[str]:
    """``decoder.layers.3`` of ``decoder.layers.3.mlp``; ``None`` outside the layers."""
    parts = scope.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["decoder", "layers"] else None


class ScopeCensus:
    """Module scope (``decoder.layers.3.mlp``) of every tensor saved during a forward."""

    def __init__(self, model: torch.nn.Module):
        self.stack, self.scope_of, self.handles = [""], {}, []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(
                lambda m, a, name=name: self.stack.append(name)))
            self.handles.append(module.register_forward_hook(self._leave))

    def _leave(self, module, args, output) -> None:
        self.stack.pop()  # returns None: the output stays the module's

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            ptr, scope = t.untyped_storage().data_ptr(), self.stack[-1]
            first = self.scope_of.setdefault(ptr, scope)
            layers = {_layer_of(first), _layer_of(scope)}
            if None not in layers and len(layers) == 2:  # one tensor several layers save
                self.scope_of[ptr] = SHARED
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def node_saved(node) -> list[torch.Tensor]:
    """Tensors a graph node keeps: built-in ``_saved_*``; custom Function ``saved_tensors``
    and tensor attributes of its ``ctx``."""
    out = []
    for attr in dir(node):
        if attr.startswith("_saved_"):
            try:
                out.extend(_tensors(getattr(node, attr)))
            except RuntimeError:  # already freed
                pass
    if hasattr(node, "saved_tensors"):
        out.extend(_tensors(node.saved_tensors))
        out.extend(t for v in vars(node).values() for t in _tensors(v))
    return out


def walk(loss: torch.Tensor, exclude: set, tokens: int) -> dict[int, dict]:
    """``{storage pointer: {bytes, dtype, shape, nodes, per_token}}`` of every tensor the
    graph of ``loss`` keeps (each storage once; ``exclude``: the parameters' storages;
    ``per_token``: a dimension is the ``tokens`` of the stream, else a fixed size such as
    a checkpoint's RNG state)."""
    storages, seen, todo = {}, set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for t in node_saved(node):
            if not t.numel() or t.untyped_storage().data_ptr() in exclude:
                continue
            s = t.untyped_storage()
            entry = storages.setdefault(s.data_ptr(), {
                "bytes": s.nbytes(), "dtype": str(t.dtype).replace("torch.", ""),
                "shape": list(t.shape), "nodes": set(), "per_token": tokens in t.shape})
            entry["nodes"].add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return storages


def split_scope(scope: str, nodes: set) -> tuple:
    """``("layer", "mlp.linear_fc1")`` for ``decoder.layers.3.mlp.linear_fc1``, else
    ``("outside", scope)``; full recompute's checkpoints save the layers' inputs in the
    decoder's scope: ``("layer", "(input, full recompute)")``."""
    parts = scope.split(".")
    if len(parts) >= 3 and parts[:2] == ["decoder", "layers"]:
        return "layer", ".".join(parts[3:]) or "(layer)"
    if scope == "decoder" and "CheckpointFunctionBackward" in nodes:
        return "layer", "(input, full recompute)"
    return "outside", scope or "(model)"


def breakdown(storages: dict, scope_of: dict, tokens: int, layers: int) -> dict:
    """Rows ``(where, scope, nodes, dtype) -> bytes per token`` (layer rows averaged over
    the layers; ``where`` "fixed": tensors whose size does not grow with the tokens, in
    bytes) and totals per ``where``."""
    rows = collections.defaultdict(float)
    for ptr, s in storages.items():
        where, scope = split_scope(scope_of.get(ptr, "(ctx attribute)"), s["nodes"])
        per = s["bytes"] / tokens / (layers if where == "layer" else 1)
        if not s["per_token"]:
            where, per = "fixed", s["bytes"]
        rows[(where, scope, "+".join(sorted(s["nodes"])), s["dtype"])] += per
    out = [{"where": k[0], "scope": k[1], "nodes": k[2], "dtype": k[3], "bytes_per_token": v}
           for k, v in sorted(rows.items())]
    totals = {w: sum(r["bytes_per_token"] for r in out if r["where"] == w)
              for w in ("layer", "outside", "fixed")}
    return {"rows": out, "totals": totals}


def micro_batch(trainer, spec, tokens: int):
    """The packed inputs of one micro-batch filled to ``tokens`` (mock documents)."""
    from megatron.skrull.micro_batch import materialize, pad_micro_batch
    from memory_allocator import filled_batch
    from skrull_ext.costmodel.model import default_cost_model

    ids = filled_batch(trainer.source, tokens)
    plan = gc_.plan_for(trainer.source.lengths[ids], default_cost_model(spec), tokens)
    parts = [materialize(trainer.source, ids, plan, mb, trainer.groups, trainer.device,
                         trainer.attention_backend) for mb in plan.dp_ranks[0]]
    return pad_micro_batch(max((p for p in parts if p is not None),
                               key=lambda x: x.input_ids.shape[1]), trainer.pad_multiple)


def _forward(model, inputs):
    losses = model(inputs.input_ids, inputs.position_ids, None, labels=inputs.labels,
                   packed_seq_params=inputs.packed_seq_params)
    return (losses * inputs.loss_mask).sum()


def census(trainer, inputs) -> dict:
    """One forward pass; the breakdown of what its graph keeps (no backward)."""
    from megatron.skrull.cpu_compat import cuda_to_cpu
    from bench_memory import _storages

    gpt = trainer.model
    while hasattr(gpt, "module"):  # mcore DDP / Float16Module
        gpt = gpt.module
    scopes = ScopeCensus(gpt)
    trainer.model.train()
    try:
        with cuda_to_cpu(trainer.device), torch.autograd.graph.saved_tensors_hooks(
                scopes.pack, lambda t: t):
            loss = _forward(trainer.model, inputs)
    finally:
        scopes.close()
    tokens = int(inputs.input_ids.shape[1])
    storages = walk(loss, set(_storages(trainer.model.parameters())), tokens)
    return breakdown(storages, scopes.scope_of, tokens, len(gpt.decoder.layers))


def peak_per_token(trainer, inputs) -> float:
    """Activation peak of one forward + backward over its tokens: the CUDA allocator's
    above what was allocated before, or on CPU the live saved tensors' peak."""
    from megatron.skrull.cpu_compat import cuda_to_cpu
    from bench_memory import SavedTensorPeak, _storages

    trainer.model.train()
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _forward(trainer.model, inputs).backward()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        tracker = SavedTensorPeak(_storages(trainer.model.parameters()))
        with cuda_to_cpu(device), tracker.hooks():
            _forward(trainer.model, inputs).backward()
        peak = tracker.peak
    trainer.model.zero_grad_buffer()
    return peak / int(inputs.input_ids.shape[1])


def model_terms(training, spec) -> dict:
    """The memory model's terms (bytes per token) and its totals for the breakdown."""
    from skrull_ext.costmodel.activations import SAVED

    layer, outside = training.layer_terms(spec), training.outside_terms(spec)
    saved = lambda ts: sum(t.bytes_per_token for t in ts if t.kind == SAVED)  # noqa: E731
    return {"layer": [vars(t) for t in layer], "outside": [vars(t) for t in outside],
            "totals": {"layer": saved(layer), "outside": saved(outside)},
            "alpha": training.activation_bytes_per_token(spec),
            "alpha_saved": training.activation_bytes_per_token(spec, kinds=(SAVED,))}


def run_setting(key: str, base: list, tokens: list, deadline: float) -> dict:
    """One recompute setting: the census at the most tokens, the peaks at each count."""
    from megatron.skrull.batch_schedule import model_spec

    cfg, trainer, vocab = gc_.start_run([*base, *RECOMPUTE[key]])
    try:
        spec = model_spec(cfg, vocab)
        training = gc_.training_memory(cfg, trainer.device, None if key == "none" else key)
        inputs = micro_batch(trainer, spec, max(tokens))
        out = {"recompute": key, "tokens": int(inputs.input_ids.shape[1]),
               "measured": census(trainer, inputs), "model": model_terms(training, spec),
               "peaks": []}
        for n in sorted(tokens, reverse=True):  # the census's batch first, the rest in time
            if out["peaks"] and time.monotonic() > deadline:
                break
            mb = inputs if n == max(tokens) else micro_batch(trainer, spec, n)
            out["peaks"].insert(0, {"tokens": int(mb.input_ids.shape[1]),
                                    "bytes_per_token": peak_per_token(trainer, mb)})
        return out
    finally:
        trainer = None
        gc_.stop_run()


def _peak_slope(peaks: list) -> float:
    """Bytes per token: the slope through the peaks (constants drop out), else the ratio."""
    if len(peaks) < 2:
        return peaks[0]["bytes_per_token"]
    (t0, b0), (t1, b1) = [(p["tokens"], p["bytes_per_token"] * p["tokens"])
                          for p in (peaks[0], peaks[-1])]
    return (b1 - b0) / (t1 - t0)


def print_setting(r: dict, device: str) -> None:
    m, model = r["measured"], r["model"]
    print(f"\n== recompute {r['recompute']}: {r['tokens']} tokens; bytes per token "
          "(layer rows: one layer, averaged)")
    for row in m["rows"]:
        unit = " B (not per token)" if row["where"] == "fixed" else ""
        print(f"  {row['where']:8s} {row['scope'][:38]:38s} {row['nodes'][:44]:44s} "
              f"{row['dtype']:9s} {row['bytes_per_token']:11.1f}{unit}")
    for where in ("layer", "outside"):
        got, want = m["totals"][where], model["totals"][where]
        print(f"  saved per {where:7s}: measured {got:11.1f}, model {want:11.1f} "
              f"({100 * (want / got - 1) if got else 0:+.2f}%)")
    print("  model terms (saved unless marked):")
    for where in ("layer", "outside"):
        for t in model[where]:
            mark = "" if t["kind"] == "saved" else f" [{t['kind']}]"
            print(f"    {where:8s} {t['name'][:70]:70s} {t['bytes_per_token']:10.1f}{mark}")
    if r["peaks"]:
        what, alpha = (("allocator", model["alpha"]) if device == "cuda"
                       else ("saved tensors", model["alpha_saved"]))
        got = _peak_slope(r["peaks"])
        print(f"  peak of forward + backward ({what}): {got:.1f} bytes/token, model "
              f"{alpha:.1f} ({100 * (alpha / got - 1):+.2f}%); tokens "
              + ", ".join(str(p["tokens"]) for p in r["peaks"]))
        r["peak_bytes_per_token"], r["peak_model"] = got, alpha


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    ap.add_argument("--shape", help="model shape (default qwen2.5-0.5b on cuda, tiny on cpu)")
    ap.add_argument("--tokens", type=int, nargs="+",
                    help="micro-batch sizes; the census runs the largest, the peak each "
                         "(default 8192 16384 on cuda, 256 512 on cpu)")
    ap.add_argument("--recompute", default="none,selective,full",
                    help="settings, in order (none, selective, full)")
    ap.add_argument("--json")
    ap.add_argument("--time-budget-s", type=float, default=60.0)
    args, launcher = ap.parse_known_args(argv)
    keys = [k for k in args.recompute.split(",") if k]
    if set(keys) - set(RECOMPUTE):
        ap.error(f"--recompute {args.recompute}: use {','.join(RECOMPUTE)}")
    tokens = args.tokens or ([8192, 16384] if args.device == "cuda" else [256, 512])
    extra = ["--device", args.device, *launcher]
    if args.device == "cpu" and not {"--bf16", "--fp16", "--fp64"} & set(launcher):
        extra.append("--bf16")
    base = gc_.launcher_argv(args.shape or ("qwen2.5-0.5b" if args.device == "cuda" else
                                            "tiny"), extra, seq_length=max(tokens),
                             bucket=max(tokens), global_batch=8)
    budget, run = gc_.Budget(args.time_budget_s), results_io.start()
    from megatron.skrull.cpu_compat import resolve_device

    result = {"environment": gc_.environment(resolve_device(args.device)),
              "launcher_flags": base, "settings": []}
    print(f"memory_breakdown: {result['environment']['device']}", flush=True)
    for i, key in enumerate(keys):
        if time.monotonic() > budget.until(i / len(keys) + 0.5 / len(keys)):
            budget.skip(f"recompute {key}")
            continue
        r = run_setting(key, base, tokens, budget.until((i + 1) / len(keys)))
        print_setting(r, args.device)
        result["settings"].append(r)
    result["budget"] = budget.report()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    results_io.record(f"memory_breakdown_{args.device}", result, run, argv,
                      script="memory_breakdown")
    return result


if __name__ == "__main__":
    main()
