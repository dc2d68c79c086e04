"""Fault-and-load proof of the contract against the testproject under gunicorn.

SDK-like clients send payments while gunicorn workers are killed, the database goes away
and comes back, connections are cut, handlers crash after writing or outlast the client's
timeout, and partition maintenance runs; then the database is checked: every logical
request answered 2xx has exactly one effect, and no principal saw another's response.

``python -m tests.reliability --profile short|long [--report PATH]``; the short profile
also runs in the test suite (``tests/test_reliability.py``).
"""
