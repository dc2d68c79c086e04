"""Fault-and-load proof of the contract against the testproject under gunicorn.

SDK-like clients send payments while gunicorn workers are killed, the database goes away
and comes back, connections are cut, handlers crash after writing, roll their own work back
behind a 201, set cookies or outlast the client's timeout, and partition maintenance runs;
the attacks of issue 9 are made once each (``attacks.py``). Then the database is checked:
every logical request answered 2xx has exactly one committed effect (no duplicate effect,
no 2xx without a commit), and no principal saw another's response.

``python -m tests.reliability --profile short|long [--report PATH]``; the short profile
also runs in the test suite (``tests/scenarios/test_reliability.py``). The chain profiles
(``chain``, ``chain-short``, ``chain_run.py``) follow each charge beyond the request: its
capture at the fake processor and its ledger posting through the outbox, relays and Celery
workers, while those are killed and the broker restarted
(``tests/scenarios/test_reliability_chain.py``).
"""
