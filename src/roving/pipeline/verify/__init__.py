"""Verification of untrusted nodes: receipts (``receipts``), the evidence a node keeps (``evidence``),
screening of what nodes report (``screen``), robust aggregation of replicas' gradients
(``aggregate``), the adversaries tests and benchmarks run (``adversary``), and the ``Verifier`` the
coordinator runs (``verifier``). Nothing is imported here, so that the run's configuration can read
``adversary`` without PyTorch."""
