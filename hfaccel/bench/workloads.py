"""Benchmark workloads: chat prompts with fixed per-request output lengths (EOS ignored)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a ten-year-old.",
    "List three fruits that are high in vitamin C.",
    "How do I boil an egg?",
    "Give me a short motivational quote.",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "Suggest a name for a small coffee shop.",
    "What are the primary colors?",
    "Write a Python function that reverses a string.",
    "How many legs does a spider have?",
    "Describe a sunset in one sentence.",
    "What is photosynthesis?",
]


@dataclass
class Workload:
    """Prompts (token ids) and how many tokens each must generate."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)


def chat_workload(
    tokenizer: Any, num_requests: int = 32, min_len: int = 8, max_len: int = 256, seed: int = 0
) -> Workload:
    """`num_requests` chat prompts, each with an output length drawn uniformly from [min_len, max_len]."""
    rng = random.Random(seed)
    prompts, lens = [], []
    for i in range(num_requests):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            question = f"{question} (variant {i // len(QUESTIONS)})"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        prompts.append([int(t) for t in ids])
        lens.append(rng.randint(min_len, max_len))
    return Workload(f"chat-{num_requests}x[{min_len},{max_len}]", prompts, lens)
