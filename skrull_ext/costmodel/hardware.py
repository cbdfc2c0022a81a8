"""Hardware presets for the iteration-time simulator (:mod:`skrull_ext.planner.simulator`).

Every constant says where it comes from: a public datasheet, the Skrull paper's measured
collective table, a measurement of this project (``benchmarks/calibrate_cpu.py``), or an
assumption of ours (marked "ours").  Constants are never tuned to reproduce the paper's
speedups.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from skrull_ext.costmodel.model import H100_NVLINK_COMM, CommModel, CostModel, ModelSpec, TimeModel


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """Per-device speeds, overheads and interconnect of a cluster.

    Attributes:
        name: Preset name.
        description: One line.
        peak_flops: Peak FLOP/s of one device in the training dtype.
        linear_efficiency: Best fraction of ``peak_flops`` reached by the matmuls.
        linear_half_tokens: Tokens per rank and micro-batch at which matmul efficiency is
            half its best: ``eff(T) = linear_efficiency * T / (T + linear_half_tokens)``.
        attention_efficiency: Best fraction of ``peak_flops`` of the attention kernel
            (forward + backward).
        attention_half_tokens: ``S_half`` of ``eff(S) = attention_efficiency * S / (S + S_half)``,
            ``S`` the query length of a block (a whole sequence or one rank's shard).
        attention_call_overhead_s: Seconds per sequence per layer (fwd + bwd) of launching
            attention (0 where one varlen kernel runs every document of a rank).
        layer_overhead_s: Seconds per layer per micro-batch (fwd + bwd) of fixed cost.
        micro_batch_overhead_s: Seconds per micro-batch of fixed cost (data, embedding,
            loss, pipeline schedule).
        gpus_per_node: Devices sharing the fast intra-node interconnect.
        intra_node_comm: Seconds of one ring step (P2P message) inside a node.
        inter_node_comm: Seconds of one ring step across nodes.
        grad_busbw_intra / grad_busbw_inter: All-reduce bus bandwidth (bytes/s) of the
            gradient reduction inside one node / across nodes.
        grad_latency_s: Fixed seconds of the gradient reduction.
        step_overhead_s: Fixed seconds per iteration outside the micro-batches and the
            gradient reduction (optimizer step, clipping, planning; default 0).
        activation_bytes: Bytes per activation element (KV messages).
        grad_bytes: Bytes per gradient element reduced.
        overlap: Whether the ring overlaps communication with attention compute.
        tensor_parallel: Devices of one tensor-parallel group this preset stands for
            (:meth:`with_tensor_parallel`; 1 = one device).
        tp_busbw: All-reduce bus bandwidth (bytes/s) of the TP group's activation
            collectives (0 without TP).
        ring_step_overhead_s: Fixed compute seconds of one ring step per layer (forward +
            backward: the kernel launches of a step), paid ``N`` times per layer by a
            micro-batch that distributes anything over ``N`` ranks (default 0).
    """

    name: str
    description: str
    peak_flops: float
    linear_efficiency: float
    linear_half_tokens: float
    attention_efficiency: float
    attention_half_tokens: float
    attention_call_overhead_s: float
    layer_overhead_s: float
    micro_batch_overhead_s: float
    gpus_per_node: int
    intra_node_comm: CommModel
    inter_node_comm: CommModel
    grad_busbw_intra: float
    grad_busbw_inter: float
    grad_latency_s: float
    activation_bytes: int
    grad_bytes: int
    overlap: bool = True
    step_overhead_s: float = 0.0
    tensor_parallel: int = 1
    tp_busbw: float = 0.0
    ring_step_overhead_s: float = 0.0

    def __post_init__(self):
        positive = ("peak_flops", "linear_efficiency", "attention_efficiency",
                    "grad_busbw_intra", "grad_busbw_inter")
        for field in positive:
            if not getattr(self, field) > 0:
                raise ValueError(f"Hardware.{field} must be > 0, got {getattr(self, field)}")
        for field in ("linear_half_tokens", "attention_half_tokens", "attention_call_overhead_s",
                      "layer_overhead_s", "micro_batch_overhead_s", "grad_latency_s",
                      "step_overhead_s", "ring_step_overhead_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"Hardware.{field} must be >= 0, got {getattr(self, field)}")
        if self.gpus_per_node < 1 or self.activation_bytes < 1 or self.grad_bytes < 1:
            raise ValueError("gpus_per_node, activation_bytes and grad_bytes must be >= 1")
        if self.tensor_parallel < 1 or (self.tensor_parallel > 1 and not self.tp_busbw > 0):
            raise ValueError("tensor_parallel must be >= 1, with tp_busbw > 0 when it is > 1")

    def with_tensor_parallel(self, tp_size: int) -> "Hardware":
        """This preset seen as one tensor-parallel group of ``tp_size`` devices per rank.

        Megatron splits every matmul and the attention heads over the TP ranks, and each
        TP rank exchanges its own heads' K/V with the matching rank of the next CP rank,
        over its own link, all at once; the gradients it reduces are its ``1/tp`` of the
        parameters.  So a TP group computes ``tp`` times the FLOP/s of one device, moves a
        ring message in the time one device moves ``1/tp`` of it, and reduces gradients
        ``tp`` times as fast; TP is the innermost group (Megatron's default order), so a
        node holds ``gpus_per_node / tp`` of them.  What TP adds, the all-reduces (or
        all-gathers and reduce-scatters with sequence parallelism, the same bytes) of
        every layer's activations, is :meth:`tp_comm_seconds`, over the gradient
        all-reduce's intra-node bus bandwidth (TP stays inside a node).
        """
        if tp_size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {tp_size}")
        if tp_size == 1:
            return self
        if tp_size > self.gpus_per_node:
            raise ValueError(f"tensor-parallel size {tp_size} > {self.gpus_per_node} devices "
                             f"per node on {self.name}: keep TP inside a node")
        t = self.tensor_parallel * tp_size
        scaled = lambda c: CommModel(sizes_bytes=tuple(x * tp_size for x in c.sizes_bytes),  # noqa: E731
                                     seconds=c.seconds)
        return dataclasses.replace(
            self, description=f"{self.description}; TP {t} per rank",
            peak_flops=self.peak_flops * tp_size,
            intra_node_comm=scaled(self.intra_node_comm),
            inter_node_comm=scaled(self.inter_node_comm),
            gpus_per_node=max(1, self.gpus_per_node // tp_size),
            grad_busbw_intra=self.grad_busbw_intra * tp_size,
            grad_busbw_inter=self.grad_busbw_inter * tp_size,
            tensor_parallel=t, tp_busbw=self.tp_busbw or self.grad_busbw_intra)

    def tp_comm_seconds(self, model: ModelSpec, tokens):
        """Seconds of the TP collectives of ``tokens`` per rank (array-like), fwd + bwd.

        Per layer two all-reduces of ``tokens x h`` activations forward (after the
        attention and the MLP) and two backward, each ``2 (t-1)/t`` of its bytes over the
        bus bandwidth; 0 without TP.  Not overlapped with compute (mcore overlaps them
        only with Transformer Engine's userbuffers, off by default).
        """
        t = self.tensor_parallel
        if t <= 1:
            return 0.0 * np.asarray(tokens, dtype=np.float64)
        per_token = (4 * model.num_layers * 2.0 * (t - 1) / t * model.hidden_size
                     * self.activation_bytes / self.tp_busbw)
        return per_token * np.asarray(tokens, dtype=np.float64)

    def linear_rate(self, tokens):
        """Matmul FLOP/s at ``tokens`` per rank (array-like)."""
        peak = self.peak_flops * self.linear_efficiency
        return peak * tokens / (tokens + self.linear_half_tokens)

    def attention_rate(self, block_tokens):
        """Attention FLOP/s for blocks of ``block_tokens`` queries (array-like)."""
        s = block_tokens
        return self.peak_flops * self.attention_efficiency * s / (s + self.attention_half_tokens)

    def ring_comm(self, group_size: int) -> CommModel:
        """The per-step model of a ring over ``group_size`` ranks (slowest link decides)."""
        return self.intra_node_comm if group_size <= self.gpus_per_node else self.inter_node_comm

    def grad_reduce_seconds(self, params: int, ranks: int) -> float:
        """Ring all-reduce of the gradients over ``ranks``: ``2 (n-1)/n * bytes / busbw``."""
        if ranks <= 1:
            return 0.0
        bw = self.grad_busbw_intra if ranks <= self.gpus_per_node else self.grad_busbw_inter
        return self.grad_latency_s + 2.0 * (ranks - 1) / ranks * params * self.grad_bytes / bw

    def micro_batch_fixed_seconds(self, model: ModelSpec) -> float:
        return self.micro_batch_overhead_s + model.num_layers * self.layer_overhead_s

    def cost_model(self, model: ModelSpec, cp_size: int, dp_size: int = 1) -> CostModel:
        """The scheduler's :class:`CostModel` of this hardware: the one time model that the
        planner's simulator also runs on (:mod:`skrull_ext.planner.simulator`).

        The matmuls' efficiency ``eff(T) = linear_efficiency T / (T + T_half)`` makes a
        rank's linear time over ``T`` tokens ``lin (T + T_half) / (peak linear_efficiency)``:
        per token at the best rate plus a fixed ``T_half`` tokens' worth per micro-batch
        (streaming the weights, the same for any ``T``), which goes into
        ``micro_batch_overhead``.  ``iteration_overhead`` is the step overhead plus the
        gradient reduction over the ``dp_size x cp_size`` ranks; the ring's steps run on
        :meth:`ring_comm` of ``cp_size`` ranks.
        """
        grad = self.grad_reduce_seconds(model.param_count(), dp_size * cp_size)
        per_token = float(model.linear_flops([1.0])[0])
        best = self.peak_flops * self.linear_efficiency
        # TP collectives grow with the tokens, as the matmuls do: folded into c_linear.
        tp = float(self.tp_comm_seconds(model, 1.0)) / per_token
        weights = per_token * self.linear_half_tokens / best
        time = TimeModel(c_linear=1.0 / best + tp,
                         c_attention=1.0 / (self.peak_flops * self.attention_efficiency),
                         micro_batch_overhead=self.micro_batch_fixed_seconds(model) + weights,
                         attention_half_tokens=self.attention_half_tokens,
                         attention_call_overhead=self.attention_call_overhead_s,
                         iteration_overhead=self.step_overhead_s + grad,
                         ring_step_overhead=self.ring_step_overhead_s)
        return CostModel(model=model, time=time, comm=self.ring_comm(cp_size),
                         bytes_per_element=self.activation_bytes)


def linear_comm(latency_s: float, bytes_per_s: float) -> CommModel:
    """``latency + bytes / bandwidth`` as a :class:`CommModel` (flat below 64 KiB)."""
    sizes = (float(1 << 16), float(1 << 30))
    return CommModel(sizes_bytes=sizes, seconds=tuple(latency_s + s / bytes_per_s for s in sizes))


def _allgather_busbw(comm: CommModel, ranks: int) -> float:
    """Bus bandwidth of a measured all_gather: ``(n-1)/n * size / time`` on its last segment."""
    _, per_byte = comm.linear_fit()
    return (ranks - 1) / ranks / per_byte


# NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s dense BF16 Tensor Core, 3.35 TB/s HBM3,
# NVLink 900 GB/s per GPU.  NVIDIA DGX H100 datasheet: 8 GPUs per node, 8x ConnectX-7
# 400 Gb/s InfiniBand NDR (one 50 GB/s port per GPU).
H100_PEAK_BF16 = 989.4e12
H100_HBM_BYTES_PER_S = 3.35e12
H100_IB_BYTES_PER_S = 400e9 / 8

H100 = Hardware(
    name="h100",
    description="4x8 H100 SXM (NVLink in a node, 400 Gb/s NDR InfiniBand per GPU across)",
    peak_flops=H100_PEAK_BF16,
    # ours: cuBLAS BF16 GEMMs of LLM shapes run at ~60% of peak; small token counts make
    # them weight-bandwidth bound: a GEMM over T tokens has ~T FLOP/byte of weights, the
    # H100 ridge point is 989.4e12 / 3.35e12 ~ 295 FLOP/byte (datasheet), so eff halves
    # near T ~ 295.
    linear_efficiency=0.60,
    linear_half_tokens=H100_PEAK_BF16 / H100_HBM_BYTES_PER_S,
    # FlashAttention-3 paper (Shah et al., arXiv 2407.08608): FlashAttention-2 reaches
    # ~35% of peak on H100; its forward throughput rises with length and saturates by
    # ~2-4K (head dim 128).  ours: S_half = 512, as causal masking and the backward pass
    # lose more at short lengths than the non-causal forward curve shows.
    attention_efficiency=0.35,
    attention_half_tokens=512.0,
    attention_call_overhead_s=0.0,  # varlen kernels: one launch for all documents
    # ours: launch and framework cost, the same order as the scheduler's default 2 ms.
    layer_overhead_s=50e-6,
    micro_batch_overhead_s=1e-3,
    gpus_per_node=8,
    # The Skrull paper's measured all_gather on one 8xH100 node (docs/design.md section 2),
    # used as the time of one ring step of that many bytes.
    intra_node_comm=H100_NVLINK_COMM,
    # ours: ~10 us NCCL P2P latency; bandwidth from the DGX H100 datasheet (above).
    inter_node_comm=linear_comm(10e-6, H100_IB_BYTES_PER_S),
    grad_busbw_intra=_allgather_busbw(H100_NVLINK_COMM, 8),
    grad_busbw_inter=H100_IB_BYTES_PER_S,
    grad_latency_s=100e-6,
    activation_bytes=2,  # bf16
    grad_bytes=2,  # bf16 gradient reduction
)

# Fitted by benchmarks/calibrate_training_cpu.py on this project's development machine (2
# vCPUs, shared; torch 2.13.0 CPU; 2 processes x 1 thread, gloo, fp32), 2026-11-22: real
# training iterations of the launcher's stack (mcore GPT, 2 layers, hidden 256, 4 heads /
# 2 KV groups, DACP attention, AdamW) on global batches of the synthetic long-tail corpus
# (CP = 2: skrull, all-cp, paper DACP, per-seq-cp; CP = 1 x DP = 2: skrull, sorted; plus
# tiny / short / medium composed batches), median of 3 interleaved repeats each (the CP = 1
# runs from a quieter pass of the same code); the simulator's constants fitted by
# Levenberg-Marquardt on log errors.  gloo P2P: 2-process ping-pong; the fitted extra
# per-message cost inside training came out ~0.  Fit error over 50 runs: mean |err| 2.7%,
# max 8.7%; validated on other seeds by benchmarks/validate_training_cpu.py (see
# docs/costmodel.md).
_CPU_COMM = CommModel(
    sizes_bytes=(65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0),
    seconds=(61.7e-6, 90.6e-6, 269.2e-6, 918.8e-6, 4346.0e-6),
)
_CPU_BUSBW = 1.0 / _CPU_COMM.linear_fit()[1]  # gloo P2P bandwidth (~4 GB/s)
CPU = Hardware(
    name="cpu",
    description="one single-threaded process per rank on a CPU machine, gloo P2P (fp32)",
    peak_flops=88.39e9,  # fitted FLOP/s of everything outside attention (matmuls dominate)
    linear_efficiency=1.0,
    linear_half_tokens=0.0,
    attention_efficiency=1.2987,  # fitted attention 114.8 GFLOP/s / 88.39
    attention_half_tokens=579.4,  # a 64-token block runs at 10% of the long-block rate
    attention_call_overhead_s=51.5e-6,  # per document (block) and layer, forward + backward
    layer_overhead_s=8925e-6,  # per layer and micro-batch (mcore modules, autograd, Python)
    micro_batch_overhead_s=0.0,  # one layer count in the fit: all fixed cost per layer
    gpus_per_node=1 << 16,  # one machine: every ring step uses the same (gloo) link
    intra_node_comm=_CPU_COMM,
    inter_node_comm=_CPU_COMM,
    grad_busbw_intra=_CPU_BUSBW,
    grad_busbw_inter=_CPU_BUSBW,
    grad_latency_s=60.7e-6,  # the smallest gloo message
    activation_bytes=4,  # fp32
    grad_bytes=4,
    step_overhead_s=7.70e-3,  # optimizer step, clipping, planning, loss normaliser
)

HARDWARE_PRESETS = {"h100": H100, "cpu": CPU}


def get_hardware(name: str) -> Hardware:
    """A preset by name (``h100``, ``cpu``)."""
    if name not in HARDWARE_PRESETS:
        raise ValueError(f"unknown hardware {name!r}: choose one of {sorted(HARDWARE_PRESETS)} "
                         "(--hardware)")
    return HARDWARE_PRESETS[name]


__all__ = ["CPU", "H100", "HARDWARE_PRESETS", "Hardware", "get_hardware", "linear_comm"]
