"""Integration tests (root, real namespaces); a package so their module names never clash with tests/unit."""
