"""Short chat prompts for driving a live service: ``fsd demo`` and ``benchmarks/load.py`` share them."""

from __future__ import annotations

PROMPTS: tuple[str, ...] = (
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about distributed systems.",
    "List three uses of a hash map.",
    "What is speculative decoding?",
    "Give a short recipe for pancakes.",
    "Summarise the plot of Hamlet in one paragraph.",
    "Describe a binary search in plain words.",
    "Name four planets and one fact about each.",
)
