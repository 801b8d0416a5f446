"""NVIDIA's files here are run by the tests of this folder, each against a server they start; pytest
must not collect them itself (qa's `*_test.py` names match its default pattern)."""

collect_ignore_glob = ["triton_server_qa/*", "triton_client_examples/*"]
