-- Lost GPU-hours per day (issue #12), now spread over the days an incident lasted. Before, an
-- incident that spanned midnight was counted whole on the day it opened: a slow node found
-- on Friday evening and drained on Monday put three days of loss on Friday.
--
-- An incident costs from its opening to its latest step (the step's time from job_steps; a
-- hang, whose job makes no steps, ends where it opened), at an even rate between them: its
-- what-if loss per step barely moves while its culprit stays the same. Each day holds the
-- share of that span it overlaps. `incidents` counts the incidents that cost something that
-- day (one that spans two days counts on both); `opened` counts those that opened that day.
CREATE OR REPLACE VIEW flare.v_incident_cost_daily AS
SELECT day, kind, culprit,
       count() AS incidents,
       countIf(toDate(opened_ts) = day) AS opened,
       countIf(status = 'open') AS still_open,
       sum(lost_gpu_seconds * share) / 3600 AS lost_gpu_hours,
       max(slowdown) AS worst_slowdown
FROM
(
    SELECT kind, culprit, status, slowdown, lost_gpu_seconds, opened_ts, day,
           if(t1 > t0,
              (least(t1, day_ns + 86400000000000) - greatest(t0, day_ns)) / (t1 - t0),
              1.0) AS share
    FROM
    (
        SELECT i.kind AS kind, i.culprit AS culprit, i.status AS status,
               i.slowdown AS slowdown, i.lost_gpu_seconds AS lost_gpu_seconds,
               i.opened_ts AS opened_ts,
               toUnixTimestamp64Nano(i.opened_ts) AS t0,
               greatest(t0, toUnixTimestamp64Nano(s.ts)) AS t1,
               arrayJoin(arrayMap(k -> addDays(toDate(i.opened_ts), k),
                                  range(toUInt32(intDiv(t1, 86400000000000)
                                                 - intDiv(t0, 86400000000000) + 1)))) AS day,
               toInt64(toUnixTimestamp(toDateTime(day, 'UTC'))) * 1000000000 AS day_ns
        FROM (SELECT * FROM flare.incidents FINAL) AS i
        LEFT JOIN (SELECT job, toInt64(step) AS step, ts FROM flare.job_steps FINAL) AS s
            ON s.job = i.job AND s.step = i.last_step
    )
)
GROUP BY day, kind, culprit;
