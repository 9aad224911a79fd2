"""Verification tools: is the KV-cache transport fast and correct on this machine (microbench), and does PD serve like one engine."""
