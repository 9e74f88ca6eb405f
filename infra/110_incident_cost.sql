-- What incidents cost (issue #12). Each incident's newest state carries its what-if cost:
-- `lost_gpu_seconds` in total and `lost_gpu_seconds_per_step` for its latest step (a hang:
-- one step time of the whole job). Rows written before this column existed read 0.
ALTER TABLE flare.incidents
    ADD COLUMN IF NOT EXISTS lost_gpu_seconds_per_step Float64 DEFAULT 0 AFTER lost_gpu_seconds;

-- Open incidents, with the per-step cost.
CREATE OR REPLACE VIEW flare.v_open_incidents AS
SELECT id, job, kind, culprit, suspect_entities, suspect_confidences, onset_step, opened_step,
       opened_ts, last_step, slowdown, lost_gpu_seconds, lost_gpu_seconds_per_step,
       evidence_steps, summary
FROM flare.incidents FINAL
WHERE status = 'open';

-- Lost GPU-hours per day, by kind and culprit, for dashboards: each incident counted once,
-- in its newest state (FINAL), on the day it opened (an incident's partition; one that spans
-- midnight is counted whole on its first day).
CREATE VIEW IF NOT EXISTS flare.v_incident_cost_daily AS
SELECT toDate(opened_ts) AS day, kind, culprit, count() AS incidents,
       countIf(status = 'open') AS still_open,
       sum(lost_gpu_seconds) / 3600 AS lost_gpu_hours,
       max(slowdown) AS worst_slowdown
FROM flare.incidents FINAL
GROUP BY day, kind, culprit;
