import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
def perm():
    m = ctypes.c_ulong(0); libc.syscall(158, 0x1022, ctypes.byref(m)); return hex(m.value)
out = {"start": perm()}
import torch, torch.nn.functional as F
out["after_import"] = perm()
what = sys.argv[1]
if what.startswith("linear"):
    M = int(what[6:]); F.linear(torch.randn(M, 256, dtype=torch.bfloat16), torch.randn(768, 256, dtype=torch.bfloat16))
elif what.startswith("sdpa"):
    L = int(what[4:]); q = torch.randn(1, 4, L, 64, dtype=torch.bfloat16); F.scaled_dot_product_attention(q, q, q, is_causal=True)
elif what == "init_amx":
    out["init_amx"] = torch.cpu._init_amx()
out["amx_tile_supported"] = torch.cpu._is_amx_tile_supported()
out["after_" + what] = perm()
print("RESULT " + json.dumps(out))
