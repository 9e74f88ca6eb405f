-- Per-step evidence against one suspect (only suspects above the noise). Ordered by entity so
-- an incident's evidence (one culprit over a step range) is a narrow range read.
CREATE TABLE IF NOT EXISTS flare.detections
(
    job         LowCardinality(String),
    entity      String                    CODEC(ZSTD(1)),
    kind        LowCardinality(String),
    step        UInt64                    CODEC(Delta, ZSTD(1)),
    ts          DateTime64(9, 'UTC')      CODEC(Delta, ZSTD(1)),
    score       Float32                   CODEC(ZSTD(1)),
    excess_s    Float32                   CODEC(ZSTD(1)),
    inserted_at DateTime DEFAULT now()    CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (job, entity, kind, step)
TTL inserted_at + INTERVAL 90 DAY;
