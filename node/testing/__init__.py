"""Harnesses for development, tests and benchmarks: local swarms, fault injection, link emulation."""
