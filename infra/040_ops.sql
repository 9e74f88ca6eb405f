-- Raw ops of sampled and irregular steps only (the worker decides which), for drill-down.
-- `ord` is the op's position in its rank's message, so (job, step, rank, ord) is the natural
-- key. `start_ns` is the wire offset from the rank's `t_start`. Short TTL: this is the bulk.
CREATE TABLE IF NOT EXISTS flare.ops
(
    job         LowCardinality(String),
    step        UInt64                    CODEC(Delta, ZSTD(1)),
    rank        UInt32                    CODEC(Delta, ZSTD(1)),
    ord         UInt32                    CODEC(Delta, ZSTD(1)),
    ts          DateTime64(9, 'UTC')      CODEC(Delta, ZSTD(1)),
    node        LowCardinality(String),
    t_start     DateTime64(9, 'UTC')      CODEC(Delta, ZSTD(1)),
    kind        LowCardinality(String),
    name        LowCardinality(String),
    group_name  LowCardinality(String),
    seq         Int64                     CODEC(Delta, ZSTD(1)),
    start_ns    Int64                     CODEC(Delta, ZSTD(1)),
    dur_ns      Int64                     CODEC(ZSTD(1)),
    bytes       Int64                     CODEC(ZSTD(1)),
    inserted_at DateTime DEFAULT now()    CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (job, step, rank, ord)
TTL inserted_at + INTERVAL 7 DAY;
