"""On an AMX CPU: a spawned python child runs one AMX instruction, with and without remote/system/amx_hook on PYTHONPATH."""
import ctypes, json, multiprocessing as mp, os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

def child(q):
    from remote.system import cpu
    q.put({"permitted_at_start": cpu.amx_permitted()})
    ctypes.CDLL(os.path.abspath("amx_lib.so")).run_tile()
    q.put({"tile": "ok"})

def trial(with_hook):
    from remote.system import cpu
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if with_hook:
        env = cpu.amx_env(env)
    os.environ.clear(); os.environ.update(env)
    ctx = mp.get_context("spawn"); q = ctx.Queue(); p = ctx.Process(target=child, args=(q,)); p.start(); p.join()
    got = {}
    while not q.empty(): got.update(q.get())
    return {"hook": with_hook, "PYTHONPATH": env.get("PYTHONPATH"), "exitcode": p.exitcode, **got}

if __name__ == "__main__":
    from remote.system import cpu
    facts = cpu.read_cpuinfo()
    out = {"model": facts["model"], "has_amx": cpu.has_amx(facts["flags"]), "kernel_allows_amx": cpu.kernel_allows_amx(),
           "parent_permitted": cpu.amx_permitted(), "trials": [trial(False), trial(True)]}
    print("RESULT " + json.dumps(out))
