import ctypes, subprocess, sys, os
libc = ctypes.CDLL(None, use_errno=True)
def perm():
    m = ctypes.c_ulong(0); libc.syscall(158, 0x1022, ctypes.byref(m)); return hex(m.value)
print("parent before", perm())
print("request rc", libc.syscall(158, 0x1023, 18), ctypes.get_errno())
print("parent after", perm(), flush=True)
r = subprocess.run(["./amx_tile"]); print("exec child rc", r.returncode, flush=True)
r = subprocess.run([sys.executable, "-c", "import multiprocessing as mp, subprocess\nctx=mp.get_context('spawn')\np=ctx.Process(target=subprocess.run, args=(['./amx_tile'],)); p.start(); p.join(); print('spawned grandchild exit', p.exitcode)"]); print("spawn rc", r.returncode)
pid = os.fork()
if pid == 0:
    os.execv("./amx_tile", ["./amx_tile"])
print("fork+exec", os.waitpid(pid, 0))
