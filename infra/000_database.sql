-- Flare's one database. Each numbered file here is a migration: storage.migrations applies it
-- once, in version order, and records it with its checksum in flare.schema_migrations, on a
-- ClickHouse server and in chDB alike. A shipped file never changes: a column change is a new
-- file (ALTER TABLE flare.t ADD COLUMN IF NOT EXISTS …) plus the column in storage/tables.py.
-- Statements stay idempotent (IF NOT EXISTS): two processes starting together may both run one.
CREATE DATABASE IF NOT EXISTS flare;
