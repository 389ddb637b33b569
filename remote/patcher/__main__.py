"""``python -m remote.patcher '{"action": "check"}'``: one action's payload as JSON."""
import json
import sys

from remote.patcher import main

if __name__ == "__main__":  # importing this module (the stdlib-only walk does) runs nothing
    print(json.dumps(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}), indent=1))
