"""The auditor of record folders and run logs (`python tools/audit.py FOLDER`): parsing, rules, checks, byte accounting."""
