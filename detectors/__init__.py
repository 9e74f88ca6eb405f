"""Pure detection algorithms (numpy, river): no Kafka, ClickHouse or I/O."""
