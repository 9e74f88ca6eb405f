-- One row per job per training step: step time, the window's normal (baseline), δ and the
-- irregular class. ReplacingMergeTree on (job, step): a replay after a crash rewrites the same
-- key, and readers use FINAL, so counts stay exact under at-least-once delivery.
-- `ts` is the step's latest t_end on a node clock (partition key: every row of one step lands
-- in the same day partition); `inserted_at` is the server clock and drives the TTL, so a
-- replayed old recording is not expired on arrival.
CREATE TABLE IF NOT EXISTS flare.job_steps
(
    job          LowCardinality(String),
    step         UInt64                    CODEC(Delta, ZSTD(1)),
    ts           DateTime64(9, 'UTC')      CODEC(Delta, ZSTD(1)),
    n_ranks      UInt32                    CODEC(ZSTD(1)),
    n_missing    UInt32                    CODEC(ZSTD(1)),
    step_time_s  Float64                   CODEC(ZSTD(1)),
    baseline_s   Float64                   CODEC(ZSTD(1)),
    delta        Float64                   CODEC(ZSTD(1)),
    irregular    LowCardinality(String),
    level_shift  Bool,
    n_detections UInt32                    CODEC(ZSTD(1)),
    inserted_at  DateTime DEFAULT now()    CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (job, step)
TTL inserted_at + INTERVAL 90 DAY;
