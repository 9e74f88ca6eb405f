"""ClickHouse DDL and deployment assets, shipped as package data."""
