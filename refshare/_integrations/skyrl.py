"""SkyRL: its actor group's fan-out (mesh dispatch puts each chunk; pass-through by value)."""

from __future__ import annotations

from .framework import Framework, Target

FRAMEWORK = Framework(
    "skyrl",
    "SkyRL 0.3.0 to 0.4.0",
    (
        (
            Target(
                "skyrl.backends.skyrl_train.workers.worker",
                "PPORayActorGroup",
                ("async_run_ray_method",),
            ),
        ),
        (  # the older skyrl-train package
            Target(
                "skyrl_train.workers.worker",
                "PPORayActorGroup",
                ("async_run_ray_method", "run_method"),
            ),
        ),
    ),
)
