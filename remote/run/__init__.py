"""A detached run of any kind: the job verbs, the run dir, root causes, test hooks.
"""
