"""The ``streamcache`` command line: one module per command beside the dispatcher in :mod:`.main`.
"""
