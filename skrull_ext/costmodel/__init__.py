"""Cost model: what a plan costs in time and memory.

- :mod:`skrull_ext.costmodel.model`: model shapes (``ModelSpec``), the time model of compute
  (``TimeModel``), communication (``CommModel``), their combination the scheduler minimises
  (``CostModel``) and the memory model that sizes the bucket (``MemoryModel``).
- :mod:`skrull_ext.costmodel.hardware`: hardware presets (``h100``, a fitted ``cpu``) that bind
  a cost model to a machine for the simulator and the planner.
- :mod:`skrull_ext.costmodel.flops`: model FLOPs of a batch from its documents' lengths
  (Megatron's ``--log-throughput`` count) and the GPUs' peaks, for TFLOP/s and MFU.
"""
