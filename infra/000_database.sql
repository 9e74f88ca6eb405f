-- Flare's one database. Every statement here is idempotent (IF NOT EXISTS) and runs unchanged
-- on a ClickHouse server and in chDB; storage.migrations applies the files in name order at start.
CREATE DATABASE IF NOT EXISTS flare;
