"""The engine: many sequences decoded together over one shared page pool, or one alone (`generate`):
one loop for both. Its modules: docs/architecture.md."""
