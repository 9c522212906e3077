"""The data format: schema and columns, checksums, the index, the shard writer and converter, and
reading shards.
"""
