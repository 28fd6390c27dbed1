"""The seeded JSON-schema family (``expeditor/bench/schema_family.py``, which the json
bench workload draws from too)."""

from expeditor.bench.schema_family import schemas

__all__ = ["schemas"]
