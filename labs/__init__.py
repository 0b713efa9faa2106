"""Teaching labs: guided exercises (one folder each, next to this file) and the code that lists, starts and
checks them. `catalog` finds the labs, `answers` compares a student's numbers with numbers recomputed from
their own runs, `checks` holds one checker per lab, `commands` the ``prfaas lab`` subcommands. See
docs/labs.md and labs/INSTRUCTORS.md.
"""
