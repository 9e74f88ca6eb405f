"""Pure detection algorithms (numpy, river): no Kafka, ClickHouse or I/O (DESIGN §4).

One job per module, in the order a step flows through them:

- `assembly`: rank-step messages → whole-step `StepFrame`s (grace period for missing ranks);
- `features`: where each rank's time went, and each collective instance's transfer;
- `peers`: which ranks do comparable work (pipeline stage, tensor-parallel replica);
- `irregularity`: the job's step time vs its normal (δ), level shifts (Page-Hinkley);
- `suspects`: one step's candidates from `compute_suspects`, `host_suspects` and
  `network_suspects`, each significant against the spread kept by `noise`;
- `evidence`: what persists across steps; `incidents`: their lifecycle; `explain`: the
  sentence an SRE reads; `hang`: hangs from heartbeats; `rows`: what storage keeps;
- `diagnoser`: `JobDiagnoser`, all of the above for one job.

`base.Stateful` is the contract of every detector with state, `segments` the vectorized
reductions they share, `config` their knobs, `testing` hand-made steps for tests and examples.
"""
