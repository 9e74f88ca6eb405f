-- Incident v1 rows (DESIGN §3). One incident keeps its deterministic id through its updates;
-- `version` = 2 * max(last_step, resolved_step) + resolved, so the newest state of an id wins
-- (FINAL), and a replayed older state can never overwrite a newer one. Suspects are two
-- parallel arrays. Partitioned by the opening time, which every state of one id shares; a
-- bloom filter on id serves GET /v1/incidents/{id}, which does not know the job.
CREATE TABLE IF NOT EXISTS flare.incidents
(
    id                  String,
    job                 LowCardinality(String),
    status              LowCardinality(String),
    kind                LowCardinality(String),
    culprit             String,
    suspect_entities    Array(String),
    suspect_confidences Array(Float64),
    onset_step          Int64,
    opened_step         Int64,
    opened_ts           DateTime64(9, 'UTC'),
    last_step           Int64,
    resolved_step       Nullable(Int64),
    slowdown            Float64,
    lost_gpu_seconds    Float64,
    evidence_steps      Int64,
    summary             String                  CODEC(ZSTD(3)),
    version             UInt64,
    inserted_at         DateTime DEFAULT now(),
    INDEX id_bloom id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toDate(opened_ts)
ORDER BY (job, id)
TTL inserted_at + INTERVAL 365 DAY;
