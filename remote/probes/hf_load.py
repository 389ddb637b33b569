"""The one probe that imports transformers, in a subprocess with a timeout.

``AutoConfig.from_pretrained`` can hang (remote code importing the world) or crash the
interpreter, and importing transformers alone takes seconds; so it runs in a child
python (``sys.executable``: the host env's own), started first and collected after the
static checks, which run meanwhile. The same child loads the tokenizer and renders the
chat template the way speculators 0.3.0 does, since both need the same import.

The child never downloads: HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are forced, and
``trust_remote_code`` is passed explicitly (``None`` would make transformers *prompt*).
Its answer is one JSON line after :data:`MARKER`; everything else it prints is kept
only as a tail for the record.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from remote.probes import Context
from remote.probes.tokenizer_data import tokenizer_files
from remote.wire.protocol import FAIL, OK, SKIPPED, WARN, record

MARKER = "@@SPECOPS-HF-LOAD@@"

#: What the child runs; its one argument is a JSON object (data, never code).
CHILD = r'''
import json, sys, time
args = json.loads(sys.argv[1])
out = {}
t0 = time.perf_counter()
try:
    import transformers
    from transformers import AutoConfig, AutoTokenizer
    out["transformers"] = transformers.__version__
except BaseException as exc:
    out["import_error"] = f"{type(exc).__name__}: {exc}"
out["import_seconds"] = time.perf_counter() - t0

def text_facts(cfg):
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    return {k: getattr(text, k, None) for k in keys}

if "import_error" not in out:
    t1 = time.perf_counter()
    try:
        cfg = AutoConfig.from_pretrained(args["path"], trust_remote_code=args["trust"])
        out["config"] = {"ok": True, "class": type(cfg).__name__, "module": type(cfg).__module__,
                         "text": text_facts(cfg)}
    except BaseException as exc:
        out["config"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out["config"]["seconds"] = time.perf_counter() - t1
    if args["tokenizer"]:
        t2 = time.perf_counter()
        try:
            tok = AutoTokenizer.from_pretrained(args["path"], trust_remote_code=args["trust"])
            info = {"ok": True, "class": type(tok).__name__, "size": len(tok),
                    "chat_template": getattr(tok, "chat_template", None) is not None}
            if info["chat_template"]:
                # what speculators 0.3.0's _detect_assistant_pattern renders
                conv = [{"role": "user", "content": "USER_MSG_1"}, {"role": "assistant", "content": "ASSISTANT_MSG_1"},
                        {"role": "user", "content": "USER_MSG_2"}, {"role": "assistant", "content": "ASSISTANT_MSG_2"}]
                try:
                    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
                    info["template_renders"] = isinstance(text, str) and "ASSISTANT_MSG_2" in text
                    info["rendered_chars"] = len(text) if isinstance(text, str) else None
                except BaseException as exc:
                    info["template_renders"] = False
                    info["template_error"] = f"{type(exc).__name__}: {exc}"
            out["tokenizer"] = info
        except BaseException as exc:
            out["tokenizer"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out["tokenizer"]["seconds"] = time.perf_counter() - t2
sys.stdout.write("\n@@SPECOPS-HF-LOAD@@" + json.dumps(out, default=str) + "\n")
sys.stdout.flush()
'''


class HfLoad:
    """A running AutoConfig/AutoTokenizer child; :meth:`result` waits for it (once)."""

    def __init__(self, model_path: str, trust_remote_code: bool, timeout_s: float, tokenizer: bool = True,
                 job_env: dict | None = None):
        self.timeout_s = timeout_s
        self.tokenizer = tokenizer
        self.started = time.perf_counter()
        # the job's own env (HF_HOME, HF_MODULES_CACHE, ...), but never a download
        env = dict(os.environ, **(job_env or {}))
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1")
        args = {"path": model_path, "trust": bool(trust_remote_code), "tokenizer": tokenizer}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace")
        self._result = None

    def result(self) -> dict:
        """The child's answer plus ``wall_seconds``; ``timed_out``/``crashed`` when it gave none."""
        if self._result is not None:
            return self._result
        left = max(0.1, self.timeout_s - (time.perf_counter() - self.started))
        try:
            output, _ = self.proc.communicate(timeout=left)
            timed_out = False
        except subprocess.TimeoutExpired:
            self.proc.kill()
            output, _ = self.proc.communicate()
            timed_out = True
        answer = {}
        tail = output or ""
        if MARKER in tail:
            tail, _, line = tail.rpartition(MARKER)
            try:
                answer = json.loads(line.strip().splitlines()[0])
            except (ValueError, IndexError):
                answer = {}
        answer.update({"wall_seconds": time.perf_counter() - self.started, "timed_out": timed_out,
                       "returncode": self.proc.returncode, "output_tail": tail[-2000:]})
        self._result = answer
        return answer


def start(ctx: Context) -> HfLoad | None:
    """Start the child unless the params skip it or there is no model dir to look at.

    A config-only model dir (no tokenizer files) loads no tokenizer: transformers would
    answer with an unrelated ``TypeError`` from deep inside a tokenizer class, while
    ``tokenizer.files`` already names what is missing.
    """
    params = ctx.params
    if params["skip_autoconfig"] or not os.path.isfile(os.path.join(params["model_path"], "config.json")):
        return None
    return HfLoad(params["model_path"], params["trust_remote_code"], params["autoconfig_timeout"],
                  tokenizer=bool(tokenizer_files(params["model_path"])), job_env=params["env"])


def records(ctx: Context, load: HfLoad | None) -> list:
    """``model.autoconfig`` and ``tokenizer.load`` from the child's answer."""
    if load is None:
        why = "skipped by skip_autoconfig" if ctx.params["skip_autoconfig"] else "no config.json to load"
        return [record("model.autoconfig", SKIPPED, why, detail={}),
                record("tokenizer.load", SKIPPED, why, detail={})]
    ans = load.result()
    base = {"wall_seconds": round(ans["wall_seconds"], 3), "import_seconds": ans.get("import_seconds"),
            "transformers": ans.get("transformers")}
    if ans["timed_out"] or "import_error" in ans or "config" not in ans:
        if ans["timed_out"]:
            summary = f"AutoConfig did not finish in {load.timeout_s:g} s"
            fix = "raise autoconfig_timeout, or look for remote code that blocks (network, big imports)"
        elif "import_error" in ans:
            summary = f"cannot import transformers: {ans['import_error']}"
            fix = "pip install 'transformers<5' in the env of the inventory's python"
        else:
            summary = f"the AutoConfig child died (exit {ans['returncode']}) without an answer"
            fix = "read detail.output_tail; run AutoConfig.from_pretrained by hand on the host"
        detail = dict(base, seconds=round(ans["wall_seconds"], 3), output_tail=ans["output_tail"])
        return [record("model.autoconfig", FAIL, summary, detail=detail, fix=fix),
                record("tokenizer.load", SKIPPED, "no answer from the transformers child", detail={})]
    if not load.tokenizer:
        tok = record("tokenizer.load", SKIPPED, f"no tokenizer files in {ctx.params['model_path']} "
                     f"(tokenizer.files says what to add): AutoTokenizer not tried", detail={})
    else:
        tok = _tokenizer_record(ctx, ans.get("tokenizer"), base)
    return [_config_record(ctx, ans["config"], base), tok]


def _config_record(ctx, cfg, base):
    detail = dict(base, seconds=round(cfg["seconds"], 3), trust_remote_code=ctx.params["trust_remote_code"])
    if not cfg["ok"]:
        detail["error"] = cfg["error"]
        needs_code = "trust_remote_code" in cfg["error"] or "does not recognize this architecture" in cfg["error"] \
            or "No such file" in cfg["error"] or "auto_map" in cfg["error"]
        fix = ("set trust_remote_code: true for this host in the inventory, and make sure the model's remote "
               "code files (auto_map in config.json) are in the model dir" if needs_code
               else "fix config.json (see detail.error), or re-download it")
        return record("model.autoconfig", FAIL, f"AutoConfig failed: {cfg['error']}", detail=detail, fix=fix)
    detail.update({"class": cfg["class"], "module": cfg["module"], "text_config": cfg["text"]})
    # transformers' view must agree with what we read from config.json ourselves.
    ours = {"num_hidden_layers": ctx.model.get("num_layers"), "hidden_size": ctx.model.get("hidden_size"),
            "num_attention_heads": ctx.model.get("num_attention_heads")}
    differ = {k: {"config.json": v, "AutoConfig": cfg["text"].get(k)} for k, v in ours.items()
              if v is not None and cfg["text"].get(k) is not None and cfg["text"].get(k) != v}
    if differ:
        detail["differs"] = differ
        return record("model.autoconfig", WARN, f"AutoConfig ({cfg['class']}) disagrees with config.json on "
                      f"{', '.join(differ)}", detail=detail)
    return record("model.autoconfig", OK, f"AutoConfig -> {cfg['class']} in {cfg['seconds']:.2f} s",
                  detail=detail)


def _tokenizer_record(ctx, tok, base):
    if tok is None:
        return record("tokenizer.load", SKIPPED, "tokenizer not loaded", detail={})
    detail = dict(base, **{k: v for k, v in tok.items() if k != "ok"})
    if not tok["ok"]:
        return record("tokenizer.load", FAIL, f"AutoTokenizer failed: {tok['error']}", detail=detail,
                      fix="make sure the tokenizer files are complete (re-download them), and set "
                          "trust_remote_code: true if the tokenizer is remote code")
    vocab = ctx.model.get("vocab_size")
    if vocab and tok["size"] > vocab:
        return record("tokenizer.load", FAIL, f"tokenizer has {tok['size']} tokens but the model's vocab_size "
                      f"is {vocab}: ids past the embedding", detail=detail,
                      fix="use the tokenizer that ships with this model")
    if tok.get("chat_template") and tok.get("template_renders") is False:
        return record("tokenizer.load", FAIL, "chat template does not render a 2-turn chat as speculators 0.3.0 "
                      "needs: " + str(tok.get("template_error") or "assistant text missing"), detail=detail,
                      fix="fix the chat_template in tokenizer_config.json / chat_template.jinja")
    return record("tokenizer.load", OK, f"{tok['class']} with {tok['size']} tokens, loaded in "
                  f"{tok['seconds']:.2f} s" + (", chat template renders" if tok.get("template_renders") else ""),
                  detail=detail)
