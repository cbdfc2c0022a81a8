"""Megatron's hybrid context parallelism flags mapped onto our layout and scheduling policy.

Megatron-LM (``--hybrid-context-parallel --max-seqlen-per-dp-cp-rank N``; mcore 0.16's
``HybridCPDataLoaderWrapper`` and ``BalancedCPScheduler`` in
``megatron/core/datasets/data_schedule.py`` and ``pipeline_parallel/hybrid_cp_schedule.py``)
gathers the sequence lengths of a global batch and shards every sequence of length ``L``
over ``2^ceil(log2(L / N))`` ranks of the **DP x CP pool** (mcore builds a process group for
every power of two up to DP x CP); ``N`` is the number of tokens one rank holds.  The pool,
not the CP group, is what a sequence may span: Megatron's own tests run it at CP 1, DP 8.

Here the same pool is one CP group of ``DP x CP`` ranks (``DP = 1``), and the policy is
``hybrid-cp`` (:func:`skrull_ext.scheduler.baselines.hybrid_cp`: per-sample power-of-two
CP sub-groups, which the DACP attention runs as sub-group rings), with
``--skrull-bucket-size N``.  Gradients are reduced over the same ranks either way (mcore
reduces over DP x CP), so only where tokens go changes.  ``--skrull-scheduler skrull``
keeps the pool and lets Skrull plan it: the one flag a hybrid-CP user changes to compare.

Megatron-LM ``dev`` (d48bd6be; pull request 5811 brings it to ``main``) renames hybrid CP
``--dynamic-context-parallel`` (``--hybrid-context-parallel`` deprecated; both at once is an
error) and packs with ``--sequence-packing-scheduler``: ``default_dynamic_cp``
(``DefaultDynamicCPScheduler``, which ``--dynamic-context-parallel`` requires and picks) or
``dp_balanced`` (``DpBalancedScheduler``: next-fit packs, every sample on the whole CP group,
no pool).  They map to the same pool with our re-implementations of those schedulers as the
policy (``dynamic-cp``, exact on the pool; ``dp-balanced``;
:mod:`skrull_ext.scheduler.megatron_packing`).  ``--min-dynamic-context-parallel-size``:
Megatron's default 1 only.

Megatron's constraints kept: no pipeline parallelism, ``--max-seqlen-per-dp-cp-rank``
required.  ``--calculate-per-token-loss`` (which Megatron requires) is how the loss is
always computed here.  docs/parallelism.md ("Megatron's hybrid CP") has the mapping table.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resolved:
    """What the hybrid/dynamic-CP, packing and bucket flags decide.

    Attributes:
        context_parallel_size: CP size to build (the DP x CP pool under hybrid/dynamic CP).
        bucket_size: Tokens per CP rank per micro-batch (``None``: missing, reported).
        scheduler: The ``--skrull-scheduler`` policy.
        pooled: Whether the DP x CP ranks form one pool (hybrid or dynamic CP).
    """

    context_parallel_size: int
    bucket_size: Optional[int]
    scheduler: str
    pooled: bool


def _bucket(ns: argparse.Namespace, problems: list[str]) -> Optional[int]:
    """``--skrull-bucket-size`` or its Megatron name; both given must agree."""
    bucket, per_rank = ns.skrull_bucket_size, ns.max_seqlen_per_dp_cp_rank
    if per_rank is not None:
        if per_rank < 1:
            problems.append(f"--max-seqlen-per-dp-cp-rank must be >= 1, got {per_rank}")
        elif bucket is not None and bucket != per_rank:
            problems.append(f"--skrull-bucket-size {bucket} and --max-seqlen-per-dp-cp-rank "
                            f"{per_rank} name the same limit (tokens per rank per micro-batch) "
                            "with different values; keep one of them")
        return per_rank
    if bucket is None:
        problems.append("--skrull-bucket-size N is required (tokens one CP rank holds per "
                        "micro-batch; Megatron's --max-seqlen-per-dp-cp-rank N is the same)")
    return bucket


def _megatron_policy(ns: argparse.Namespace, p: list[str]) -> tuple[bool, Optional[str]]:
    """``(pooled, default policy)`` of Megatron's hybrid/dynamic CP and packing flags."""
    hybrid, dynamic = ns.hybrid_context_parallel, ns.dynamic_context_parallel
    packing = ns.sequence_packing_scheduler
    if hybrid and dynamic:
        p.append("--hybrid-context-parallel and --dynamic-context-parallel are the same mode "
                 "(Megatron-LM deprecates the first and refuses both); keep "
                 "--dynamic-context-parallel")
    if dynamic and packing not in (None, "default_dynamic_cp"):
        p.append(f"--dynamic-context-parallel needs --sequence-packing-scheduler "
                 f"default_dynamic_cp (as in Megatron), got {packing}; drop the flag")
    if packing == "default_dynamic_cp" and not dynamic:
        p.append("--sequence-packing-scheduler default_dynamic_cp needs "
                 "--dynamic-context-parallel (the DP x CP pool its groups span); add it")
    if ns.min_dynamic_context_parallel_size != 1:
        p.append(f"--min-dynamic-context-parallel-size "
                 f"{ns.min_dynamic_context_parallel_size}: only Megatron's default 1 is "
                 "supported (the smallest group is one rank); drop the flag")
    if dynamic:
        return True, "dynamic-cp"
    if hybrid:
        return True, "hybrid-cp"
    return False, "dp-balanced" if packing == "dp_balanced" else None


def resolve(ns: argparse.Namespace, world_size: int) -> tuple[Resolved, list[str]]:
    """The CP size, bucket and policy of the parsed flags, and the problems found.

    Args:
        ns: The launcher's parsed namespace (:func:`megatron.skrull.flags.build_parser`).
        world_size: Processes in the run.

    Returns:
        ``(resolved, problems)``; each problem is one line naming the fix.
    """
    p: list[str] = []
    bucket = _bucket(ns, p)
    pooled, policy = _megatron_policy(ns, p)
    scheduler = ns.skrull_scheduler or policy or "skrull"
    cp = ns.context_parallel_size
    if not pooled:
        return Resolved(context_parallel_size=cp, bucket_size=bucket, scheduler=scheduler,
                        pooled=False), p
    flag = "--dynamic-context-parallel" if ns.dynamic_context_parallel else \
        "--hybrid-context-parallel"
    if ns.max_seqlen_per_dp_cp_rank is None:
        p.append(f"{flag} needs --max-seqlen-per-dp-cp-rank N (the tokens one rank holds per "
                 "micro-batch), as in Megatron")
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    if pp > 1:
        p.append(f"{flag} is not supported with pipeline parallelism (as in Megatron); use "
                 "--pipeline-model-parallel-size 1")
    elif min(tp, cp) >= 1 and world_size % (tp * cp) == 0:
        cp = world_size // tp  # the DP x CP pool (else ParallelArgs names the bad sizes)
    return Resolved(context_parallel_size=cp, bucket_size=bucket, scheduler=scheduler,
                    pooled=True), p
