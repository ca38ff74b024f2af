"""Generation interface and backends."""
