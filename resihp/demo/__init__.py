"""``resihp demo``: the platform end to end, each component its own process on one bus.

Modules: ``story`` (the job and the faults the demo injects, as files the real commands read),
``procs`` (starting, watching and stopping the component processes), ``sim_workload`` (the
simulator's entry point with its clock on the wall clock), ``watch`` (an observer that folds the
whole log into what the progress line and the summary say, and records it as a trace),
``progress`` (the status line), ``summary`` (throughput windows, detection matching, the printed and JSON summaries) and ``run``
(the orchestration).
"""
