"""The node-local cache: installs, identity, accounting and eviction, the prefetcher and the plan's
advice.
"""
