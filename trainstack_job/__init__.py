"""trainstack's job contract and a tiny helper for job authors (standard library only)."""
