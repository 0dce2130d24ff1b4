"""The cluster simulator: the trainer's telemetry at 8 to 100,000 GPUs, with ground truth.

``presets`` (model, GPU, cluster), ``workload`` (packed variable-length micro-batches), ``cost``
(chunk and communication times), ``faults`` (fail-slow / fail-stop and their truth events),
``scenario`` (YAML files), ``engine`` (the steppable simulator), ``telemetry`` (events the real
trainer emits), ``runner`` (closed loop over a bus), ``wire`` (the ranks' records written straight
from the timings) and ``publishers`` (a step published by several processes). See docs/simulator.md.
"""
