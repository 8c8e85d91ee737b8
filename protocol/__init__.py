"""Wire protocol of SkipPipe Swarm: versioned msgpack envelopes and tensor frames.

This package imports nothing else of ours, so every other package can depend on it.
"""
