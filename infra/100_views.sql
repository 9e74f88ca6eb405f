-- Views for SQL dashboards (Grafana and friends). All read with FINAL, so they are exact under
-- at-least-once delivery.

-- Step time, baseline and δ per job and step.
CREATE VIEW IF NOT EXISTS flare.v_job_steps AS
SELECT job, step, ts, step_time_s, baseline_s, delta, irregular, level_shift,
       n_ranks, n_missing, n_detections
FROM flare.job_steps FINAL;

-- Per-rank scores over the last 100 steps of each job (relative to the job's newest step, not
-- the wall clock, so replayed or paused jobs still show).
CREATE VIEW IF NOT EXISTS flare.v_rank_scores AS
SELECT r.job AS job, r.rank AS rank, any(r.node) AS node, count() AS steps,
       max(r.step) AS last_step,
       avg(r.compute_ratio) AS compute_ratio, avg(r.step_s) AS step_s,
       avg(r.compute_s) AS compute_s, avg(r.comm_s) AS comm_s, avg(r.gap_s) AS gap_s,
       avg(r.wait_s) AS wait_s, avg(r.caused_wait_s) AS caused_wait_s,
       sum(r.caused_wait_s) AS caused_wait_total_s
FROM flare.rank_steps AS r FINAL
INNER JOIN (SELECT job, max(step) AS last FROM flare.job_steps GROUP BY job) AS j ON r.job = j.job
WHERE r.step + 100 > j.last
GROUP BY r.job, r.rank;

-- Incidents whose newest state is open.
CREATE VIEW IF NOT EXISTS flare.v_open_incidents AS
SELECT id, job, kind, culprit, suspect_entities, suspect_confidences, onset_step, opened_step,
       opened_ts, last_step, slowdown, lost_gpu_seconds, evidence_steps, summary
FROM flare.incidents FINAL
WHERE status = 'open';
