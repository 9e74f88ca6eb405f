"""`flare drill` and `flare chaos`: real faults injected into real training.

- `testbed`: a run's own hosts, Linux network namespaces joined by a bridge;
- `faults`: the faults themselves (a cgroup CPU quota, a tbf rate limit, a freeze, a kill),
  each applied and undone;
- `train`: the training program every rank of a drill runs (torch gloo, the Flare hook on);
- `run`: one drill from start to verdict.
"""
