"""OpenRLHF: its actor group's fan-outs (the same lists go to actor, critic, reference)."""

from __future__ import annotations

from .framework import Framework, Target

FRAMEWORK = Framework(
    "openrlhf",
    "OpenRLHF 0.11.2",
    (
        (
            Target(
                "openrlhf.trainer.ray.launcher",
                "RayActorGroup",
                ("async_run_method_batch", "async_run_method"),
            ),
        ),
    ),
)
