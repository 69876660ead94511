"""NeMo-RL: its worker group's fan-outs, and its ``BatchedDataDict``.

Each of ``RayWorkerGroup``'s ``run_*`` methods puts its data itself and fans out; the same
data goes to the policy's and the reference's log-prob calls. With its optional
TransferQueue data plane (``data_plane.enabled``) the driver holds no batch to share.
"""

from __future__ import annotations

from typing import Any

from .._keys.tables import builtin_fingerprints
from .framework import Framework, Target

FRAMEWORK = Framework(
    "nemo_rl",
    "NeMo-RL main (2026-08)",
    (
        (
            Target(
                "nemo_rl.distributed.worker_groups",
                "RayWorkerGroup",
                (
                    "run_all_workers_single_data",
                    "run_all_workers_multiple_data",
                    "run_all_workers_sharded_data",
                    "run_single_worker_single_data",
                ),
            ),
        ),
    ),
)


@builtin_fingerprints.registers_lazy("nemo_rl.distributed.batched_data_dict", "BatchedDataDict")
def attributes_fingerprint(obj: Any) -> Any:
    """A ``collections.UserDict`` subclass with no pickling of its own pickles its
    attributes: that is what its key covers."""
    return vars(obj)
