"""Test helpers shared by several test files, as a package (``from helpers.resume import ...``).

The older single-module helpers (``loader_helpers``, ``dist``, ``servers``...) stay beside
the tests; pytest puts ``tests/`` on ``sys.path`` for both.
"""
