"""Helpers below every layer: decoder/, policies/, sim/, controller/ and the CLI may all import this; it
imports nothing of the project (only the standard library and pydantic)."""
