"""The built-in demo model: a tiny Qwen3 checkpoint built offline so pdserve serves with no downloads."""
