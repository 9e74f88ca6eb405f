"""FastAPI service answering SRE incident queries from ClickHouse."""
