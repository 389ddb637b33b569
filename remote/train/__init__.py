"""A draft: the train task, its supervisor, plan and memory, regeneration and evaluation.
"""
