"""The paged K/V cache every model of a run shares: its page pool, and how a pass over a flat batch indexes it."""
