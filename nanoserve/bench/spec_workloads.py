"""The prompts of `nanoserve bench spec`: four that copy from their context, where speculative
decoding should pay, and open chat, where it must not cost. Written here (not read from files)
so that the benchmark runs the same anywhere."""

from __future__ import annotations

import json

RENAME_SOURCE = '''\
class Inventory:
    """Items on the shelves of one small shop, with their counts."""

    def __init__(self, name):
        self.name = name
        self.counts = {}

    def add(self, item, count=1):
        """Put `count` more of `item` on the shelves."""
        self.counts[item] = self.counts.get(item, 0) + count

    def remove(self, item, count=1):
        """Take `count` of `item` off the shelves; False if there are not enough."""
        if self.counts.get(item, 0) < count:
            return False
        self.counts[item] -= count
        if self.counts[item] == 0:
            del self.counts[item]
        return True

    def total(self):
        """How many things are on the shelves."""
        return sum(self.counts.values())

    def report(self):
        """One line per item, sorted by name."""
        lines = [f"{self.name}:"]
        for item in sorted(self.counts):
            lines.append(f"  {item}: {self.counts[item]}")
        return "\\n".join(lines)


def restock(inventory, orders):
    """Add every (item, count) of `orders` to `inventory`."""
    for item, count in orders:
        inventory.add(item, count)
    return inventory.total()
'''

PASSAGE = (
    "The harbour town woke before the sun. Fishermen carried their nets down the stone steps "
    "while the baker opened his shutters and the smell of bread drifted over the water. By six "
    "the first boats had left, their engines coughing in the cold air, and the gulls followed "
    "them out past the lighthouse. The harbour master wrote each boat's name in a thick book "
    "and the hour it sailed, as his father had done before him. In the afternoon the boats came "
    "back low in the water, and the whole town came down to the quay to see what the sea had "
    "given that day.")

QUESTIONS = ("Who opened his shutters?", "Where did the gulls follow the boats?",
             "What did the harbour master write in his book?")

RECORD = {"id": 4711, "name": "Harbour Bakery", "open": True, "address": {
    "street": "Quay Road 3", "town": "Porthmoor", "postcode": "PM1 4QX"},
    "products": [{"name": "bread", "price": 2.5, "daily": 40},
                 {"name": "buns", "price": 0.8, "daily": 120},
                 {"name": "pie", "price": 4.0, "daily": 15}],
    "staff": ["Ann", "Tom", "Lea"]}

CHAT_PROMPTS = (
    "Tell me a short story about a fox who learns to swim.",
    "Give me three tips for sleeping better.",
    "What could I cook for dinner with rice, eggs and spinach?",
    "Explain to a child why the sky is blue.",
    "Write a short poem about autumn leaves.",
    "How do I start learning to play the guitar?",
    "What are the pros and cons of working from home?",
    "Describe a perfect day at the beach.",
)

COPY_WORKLOADS = {
    "rename": "Rewrite this Python file, renaming the class `Inventory` to `Stock` everywhere. "
              f"Answer with the whole file and nothing else.\n\n```python\n{RENAME_SOURCE}```",
    "passage": f"Copy the following passage exactly, word for word:\n\n{PASSAGE}",
    "quote": f"Read the passage, then answer each question by quoting the sentence of the "
             f"passage that answers it.\n\n{PASSAGE}\n\n"
             + "\n".join(f"{i + 1}. {q}" for i, q in enumerate(QUESTIONS)),
    "json": "Reformat this JSON with an indentation of two spaces, keeping every key and "
            f"value in the same order:\n\n{json.dumps(RECORD)}",
}


def workload_prompts(name: str, count: int) -> list[str]:
    """`count` user messages of one workload (chat cycles through its prompts)."""
    if name == "chat":
        return [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(count)]
    return [COPY_WORKLOADS[name]] * count
