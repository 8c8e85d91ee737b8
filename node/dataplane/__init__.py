"""Peer-to-peer transport of activations, gradients and stage state, and its guard."""
