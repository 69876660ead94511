"""What the benchmarks share, once: ``session`` (a local Ray and its object store), ``stats``
(interleaving, medians, bootstrap intervals), ``report`` (units, tables, the record of a run,
writing Markdown, JSON and plots), ``options`` (the command line), ``cluster`` (a cluster
simulated on one machine) and, for the RL-step replays, ``steps`` (strategies, each call
timed, bytes stored), ``ideal`` (the floor they are compared with) and ``step_report``."""
