"""SkipPipe scheduling: cost model, stage allocation, skip-aware path scheduling, simulator, baselines.

Pure functions over plain data: no I/O, no network, no torch. Imports only ``protocol`` types.
"""
