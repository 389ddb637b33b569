"""Extraction of hidden states: supervisor, plan, dataset, samples, shards, replicas, engines.
"""
