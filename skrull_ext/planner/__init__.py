"""The cluster planner (``skrull-plan``): plan a cluster before you book it.

- :mod:`skrull_ext.planner.cli`: the ``skrull-plan`` command (also ``python -m skrull_ext.planner``).
- :mod:`skrull_ext.planner.profiles`: bundled and user length profiles (``data/*.json``).
- :mod:`skrull_ext.planner.lengths_io`: reading lengths (JSON, ``.npy``, text, Megatron ``.idx``).
- :mod:`skrull_ext.planner.simulator`: the iteration-time simulator of a plan.
- :mod:`skrull_ext.planner.evaluate`: schedule with every policy and simulate side by side.
- :mod:`skrull_ext.planner.plotting`: the length histogram and per-rank timeline PNG.
"""
