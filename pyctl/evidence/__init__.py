"""The evidence store's schema: every table in one place (schema.py), one
SCHEMA_VERSION, migrations from every earlier version. docs/schema.md
describes each table and column (tests/test_schema.py keeps it exact)."""

from pyctl.evidence.schema import SCHEMA_VERSION, TABLES, SchemaError, ensure_schema

__all__ = ["SCHEMA_VERSION", "TABLES", "SchemaError", "ensure_schema"]
