"""ROLL: its clusters' fan-out, and its ``DataProto``.

A ``Cluster`` binds each worker method when it is built, with a dispatch that chunks the
batch and ends in ``Cluster.execute_all_async`` (or ``execute_rank_zero_async``), looked up
on the class at call time: that is what ``enable("roll")`` wraps. The DP-MP compute
dispatch sends each data-parallel chunk by value to every tensor-parallel rank, with no
``ray.put`` anywhere on the path.
"""

from __future__ import annotations

from .framework import Framework, Target

FRAMEWORK = Framework(
    "roll",
    "ROLL main 8eb27cc2 (2026-08)",
    (
        (
            Target(
                "roll.distributed.executor.cluster",
                "Cluster",
                ("execute_all_async", "execute_rank_zero_async"),
            ),
        ),
        (Target("roll.distributed.executor.cluster", "Cluster", ("execute_all_async",)),),
    ),
)
