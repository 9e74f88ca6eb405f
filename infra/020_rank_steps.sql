-- One row per rank per step: where each rank's time went and how much it made peers wait.
-- Natural key (job, step, rank); seconds as Float32 (µs resolution is plenty, half the bytes).
CREATE TABLE IF NOT EXISTS flare.rank_steps
(
    job           LowCardinality(String),
    step          UInt64                   CODEC(Delta, ZSTD(1)),
    rank          UInt32                   CODEC(Delta, ZSTD(1)),
    ts            DateTime64(9, 'UTC')     CODEC(Delta, ZSTD(1)),
    node          LowCardinality(String),
    step_s        Float32                  CODEC(ZSTD(1)),
    compute_s     Float32                  CODEC(ZSTD(1)),
    comm_s        Float32                  CODEC(ZSTD(1)),
    gap_s         Float32                  CODEC(ZSTD(1)),
    wait_s        Float32                  CODEC(ZSTD(1)),
    caused_wait_s Float32                  CODEC(ZSTD(1)),
    compute_ratio Float32                  CODEC(ZSTD(1)),
    n_ops         UInt32                   CODEC(ZSTD(1)),
    inserted_at   DateTime DEFAULT now()   CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (job, step, rank)
TTL inserted_at + INTERVAL 90 DAY;
