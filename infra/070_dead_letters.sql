-- Inputs that could not be used, with the reason; keyed by their Kafka coordinates so a
-- re-delivered bad message is stored once (readers use FINAL).
CREATE TABLE IF NOT EXISTS flare.dead_letters
(
    topic       LowCardinality(String),
    partition   Int32,
    offset      Int64                     CODEC(Delta, ZSTD(1)),
    reason      String                    CODEC(ZSTD(3)),
    payload_b64 String                    CODEC(ZSTD(3)),
    inserted_at DateTime DEFAULT now()    CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(inserted_at)
ORDER BY (topic, partition, offset)
TTL inserted_at + INTERVAL 30 DAY;
