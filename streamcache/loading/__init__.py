"""The training-loop side: StreamDataset, StreamLoader, batching, the topology and the by-id
DatasetReader.
"""
