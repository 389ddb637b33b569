"""Test host only: vLLM 0.16's CPU rotary op mis-rotates 3-D [tokens, heads, dim] inputs
(DeepSeek's q_pe); use forward_native for those. Installed into test host envs by
specops.testhost.hostenv.make_overlay_env (a .pth imports it at start-up)."""
import importlib.abc
import importlib.util
import sys

TARGET = "vllm.model_executor.layers.rotary_embedding.base"


def _fix(module):
    cls = module.RotaryEmbedding
    original = cls.forward_cpu

    def forward_cpu(self, positions, query, key=None):
        if query.dim() > 2 or (key is not None and key.dim() > 2):
            return self.forward_native(positions, query, key)
        return original(self, positions, query, key)

    cls.forward_cpu = forward_cpu


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_and_fix(module):
            exec_module(module)
            _fix(module)

        spec.loader.exec_module = exec_and_fix
        return spec


sys.meta_path.insert(0, _Finder())
