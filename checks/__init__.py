"""What the tests and the scripts both use to check the project: transformers as the oracle
(oracle.py), the checks of a served model shared by the server tests and scripts/verify.py
(sequence_checks, reuse_checks, swap_checks, programs, device_checks), the abuse cases shared
by tests/test_hardening.py and scripts/abuse.py, and the doubles of the pure-Python tests
(fakes.py: a clock, an artifact described in code, a runtime that compiles nothing;
sampling_reference.py: sampling by the book).

Not part of the installed package: the tests reach it through pytest's `pythonpath` (the
repository root), the scripts by putting the root on sys.path. Nothing is imported here, so
the pure-Python tests' import guard (tests/unit/conftest.py) sees only what each module needs.
"""
