"""The SkipPipe Swarm node: daemon, CLI, RPC, stage runtime and trainer."""

__version__ = "0.1.0"
