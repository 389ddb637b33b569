"""Facts about this machine: CPU, installed versions, model config, signals, processes, GPUs.
"""
