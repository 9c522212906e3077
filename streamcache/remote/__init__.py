"""Remote storage: fsspec filesystems, atomic publishing, and the fetcher (retries, timeouts,
bounded bodies).
"""
