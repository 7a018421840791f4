"""The benchmark suite of `bench/run.py`: one module per measurement, plus the shared pieces
(topics and clients in env.py, input backlogs in backlog.py, processes in procs.py, committed-offset
progress in progress.py)."""
