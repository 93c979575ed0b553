"""One /metrics for the router: its models' servers' Prometheus texts as one exposition.

Each model's server labels its series with `model_name` (as vLLM's metrics do), so the series
never collide; only each family's `# HELP` and `# TYPE` lines would repeat, which the text
format forbids. They are kept once, with every server's samples of the family under them."""

from __future__ import annotations


def merge_expositions(texts: list[str]) -> str:
    """The families of all `texts`, in the order first seen, each declared once."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for text in texts:
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                lines = headers.setdefault(family, [])
                samples.setdefault(family, [])
                if len(lines) < 2 and line not in lines:
                    lines.append(line)
            elif not line.startswith("#"):
                samples.setdefault(family, []).append(line)
    out: list[str] = []
    for family, lines in samples.items():
        out.extend(headers.get(family, []))
        out.extend(lines)
    return "\n".join(out) + ("\n" if out else "")
