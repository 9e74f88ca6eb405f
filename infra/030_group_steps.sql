-- One row per communication group per step (`group_name` is the wire `group`, e.g. dp.2;
-- `group` itself is an SQL keyword and would need quoting in every dashboard query).
CREATE TABLE IF NOT EXISTS flare.group_steps
(
    job            LowCardinality(String),
    step           UInt64                  CODEC(Delta, ZSTD(1)),
    group_name     LowCardinality(String),
    ts             DateTime64(9, 'UTC')    CODEC(Delta, ZSTD(1)),
    n_members      UInt32                  CODEC(ZSTD(1)),
    n_instances    UInt32                  CODEC(ZSTD(1)),
    comm_s         Float32                 CODEC(ZSTD(1)),
    transfer_s     Float32                 CODEC(ZSTD(1)),
    wait_s         Float32                 CODEC(ZSTD(1)),
    transfer_ratio Float32                 CODEC(ZSTD(1)),
    inserted_at    DateTime DEFAULT now()  CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (job, step, group_name)
TTL inserted_at + INTERVAL 90 DAY;
