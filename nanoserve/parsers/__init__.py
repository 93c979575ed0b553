"""Chat output parsers: a model's text split into reasoning, content and tool calls, emitted as
neutral events (`events.py`) that every API endpoint formats into its own wire format. Nothing
here knows HTTP, a wire format or the engine."""
