"""Anthropic's Messages API (`/v1/messages`), for Claude Code and the `anthropic` SDKs."""
