"""The node agent behind ``resihp run``: one per node, built on torch.distributed.elastic.

torch's ``LocalElasticAgent`` starts and watches this node's ranks and, by default, restarts the
whole worker group after a failure; its c10d rendezvous handler forms the world. What the
platform adds, one module each:

* ``options``: torchrun's own argument parser plus the platform's flags, and the LaunchConfig;
* ``store``: the rendezvous store bound to one address (loopback by default), and the job check
  that turns an agent of another job into a clear error instead of a rendezvous timeout;
* ``pcontext``: the process contexts the agent starts ranks in: each rank watched on its own (a
  death need not stop its peers), and optionally forked from a server that preloaded modules;
* ``child``: the wrapper every rank runs in, so no rank outlives its agent (PR_SET_PDEATHSIG) and
  each can dump its stacks on demand (faulthandler);
* ``flight``: the per-rank flight record (the step and the last op each rank entered);
* ``hang``: judging a step that ran past its deadline, and the report naming the stuck op;
* ``predicted``: the cost model's predicted iteration time for the job, read from the bus (the hang
  deadline's base);
* ``shrink``: in-job fail-stop recovery (``--on-failure shrink``): the survivors re-form the world
  without the lost rank, restore state from the most advanced survivor and train on; a benched rank
  rejoins at the next step;
* ``presence``: every agent's connection to every other, so a survivor sees at once that an agent
  died (its sockets closed) and marks its ranks lost (shrink);
* ``vacancy``: the place a dead agent left, and the rendezvous handler with which a replacement
  (``--join-running``) takes it;
* ``node``: the agent itself (heartbeats on the bus, hang checks, marking lost ranks for the
  shrink);
* ``recovery_log``: each recovery's phase timings, logged and published;
* ``node_stop``: a running node's ``stop`` orders from the bus, and the stop itself;
* ``launch``: ``run_agent``, the whole command as named steps (``AgentLaunch``) with one-line errors;
* ``sample_job``: a small gloo job that checkpoints, resumes, keeps a flight record and recovers in
  place under ``--on-failure shrink`` (its state is independent of the world size).
"""
