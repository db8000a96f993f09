"""Tools: the `nexttoken` command and what it runs over recorded runs.

`cli` (argument parsing, one-line errors), `audit` (re-verify a run; `rederived` rebuilds its
computed files from their stored inputs), `rundiff` (explain how two runs differ), `revisions`
(read a past run from git + the DVC cache) and `sweep` (experiments as one table and plots).
"""
