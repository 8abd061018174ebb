"""The overlap benchmark: variants, timing, the report, and shaped links (network namespaces and ``tc``)."""
