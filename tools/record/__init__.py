"""Record folders (`python tools/make_record.py`): the run checks, the README, the smoke run, the run folders."""
