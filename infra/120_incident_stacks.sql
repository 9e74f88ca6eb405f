-- Hang forensics (issue #14): a hang incident carries the ranks' Python stacks merged, one
-- entry per distinct stack with the ranks there and not there (IncidentV1.stacks, JSON).
-- Empty for every other incident and for rows written before this column existed.
ALTER TABLE flare.incidents
    ADD COLUMN IF NOT EXISTS stacks String DEFAULT '' AFTER summary;
