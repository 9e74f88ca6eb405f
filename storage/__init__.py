"""The ClickHouse seam: client, migrations, writer, reader, and an in-memory fake."""
