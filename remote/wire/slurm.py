"""What both sides know of Slurm (stdlib only): its time format, its gres, its job states.

The laptop checks an inventory's ``slurm.time_limit`` with :func:`time_limit_minutes`, the
host reads the partition's ``MaxTime`` from ``sinfo`` with the same function, and a job's
state (``squeue``/``scontrol``) is named with its fix from :data:`JOB_STATES`::

    >>> time_limit_minutes("1-02:00:00"), time_limit_minutes("90"), time_limit_minutes("UNLIMITED")
    (1560.0, 90.0, None)
    >>> gres_gpus("gpu:h100:8(S:0-1)")
    8
"""
from __future__ import annotations

import re

_DAYS = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
UNLIMITED = ("infinite", "unlimited", "none")


def time_limit_minutes(text: str) -> float | None:
    """Minutes of a Slurm time (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``); None: unlimited.

    :raises ValueError: for text that is none of these.
    """
    text = str(text).strip()
    if text.lower() in UNLIMITED:
        return None
    match = _DAYS.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a Slurm time: write MINUTES, HH:MM:SS or D-HH:MM:SS (e.g. 240, "
                         f"04:00:00, 1-00:00:00)")
    days, a, b, c = match.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (nums + [0, 0])[:3]
        return int(days) * 1440 + hours * 60 + minutes + seconds / 60
    if len(nums) == 1:
        return float(nums[0])
    if len(nums) == 2:  # M:S
        return nums[0] + nums[1] / 60
    return nums[0] * 60 + nums[1] + nums[2] / 60


def gres_gpus(gres: str | None) -> int:
    """GPUs per node in a gres text (``gpu:8``, ``gpu:h100:8(S:0-1)``, ``gpu:a100:4,shard:8``); 0: none."""
    total = 0
    for item in str(gres or "").split(","):
        parts = re.sub(r"\(.*?\)", "", item.strip()).split(":")
        if parts[0] != "gpu":
            continue
        count = parts[-1] if len(parts) > 1 else "1"
        total += int(count) if count.isdigit() else 1
    return total


def request_options(slurm: dict, *, time_limit: bool = True) -> list:
    """sbatch/srun options of a host's slurm mapping: partition, account, qos, gres, time limit."""
    words = ["-p", slurm["partition"]]
    for key, flag in (("account", "-A"), ("qos", "--qos"), ("gres", "--gres"), ("time_limit", "-t")):
        if slurm.get(key) not in (None, "") and (time_limit or key != "time_limit"):
            words += [flag, str(slurm[key])]
    return words


def setup_words(setup: str | None) -> list:
    """What runs a host's ``slurm.setup`` line (``module load ...``, a container's env) on a compute node before the
    command that follows these words: a shell runs the line, then execs the command in its place (none: no words)."""
    return ["sh", "-c", f'{setup}\nexec "$0" "$@"'] if setup else []


#: Slurm's job states (``squeue -o %T``, ``scontrol show job``'s JobState): what each means for a run,
#: whether the job is still alive, and what to do. One table: the host names a state with it, status shows it.
JOB_STATES = {
    "PENDING": ("pending", True, "the job waits for nodes ({reason}); it starts by itself (squeue -j {job} shows "
                                 "why), or ask for less: a smaller time_limit, another partition"),
    "CONFIGURING": ("starting", True, None),
    "RUNNING": ("running", True, None),
    "COMPLETING": ("completing", True, None),
    "SUSPENDED": ("suspended", True, "an admin or a preemption suspended the job; it goes on once resumed"),
    "REQUEUED": ("requeued", True, "Slurm put the job back in the queue; it starts again and resumes the run"),
    "REQUEUE_HOLD": ("held", True, "the job was requeued and held: scontrol release {job}"),
    "RESV_DEL_HOLD": ("held", True, "the job's reservation was deleted: scontrol release {job}"),
    "COMPLETED": ("completed", False, None),
    "FAILED": ("failed", False, "the job's script exited non-zero: read the run's logs (specops logs), fix the "
                                "cause, then run the same command again to resume"),
    "CANCELLED": ("cancelled", False, "the job was cancelled (scancel, or an admin); run the same command again "
                                      "to resume"),
    "TIMEOUT": ("timed out", False, "the job reached its time limit; run the same command again to resume after "
                                    "the last complete sample, or raise slurm.time_limit (up to the partition's "
                                    "MaxTime)"),
    "OUT_OF_MEMORY": ("out of memory", False, "the job went over its memory; ask for more (sbatch --mem via the "
                                              "partition's defaults) or lower batch_size, then run it again"),
    "NODE_FAIL": ("node failure", False, "a node of the job failed; run the same command again to resume on "
                                         "another node (sinfo -R says why the node is down)"),
    "PREEMPTED": ("preempted", False, "a job of higher priority took the nodes; run the same command again "
                                      "to resume after the last complete sample"),
    "BOOT_FAIL": ("boot failure", False, "a node failed to boot for the job; run the same command again"),
    "DEADLINE": ("past its deadline", False, "the job could not finish by its deadline; run it again"),
}


#: a pending job that Slurm holds (its reason: JobHeldUser, JobHeldAdmin, launch_failed_requeued_held, ...) never
#: starts by itself, whatever the nodes
HELD_PENDING = ("held", True, "Slurm holds the job ({reason}): it does not start by itself; release it with "
                              "scontrol release {job} (a launch that failed on a node: sinfo -R names the node and "
                              "why)")


def job_state(state: str, *, job: str = "", reason: str = "") -> dict:
    """``{"slurm": "TIMEOUT", "state": "timed out", "alive": False, "fix": ...}`` for a Slurm state word."""
    word = str(state or "").split()[0].rstrip("+") if state else "UNKNOWN"
    named, alive, fix = JOB_STATES.get(word, (word.lower() or "unknown", False,
                                              "Slurm reports a state specops does not know: scontrol show job "
                                              "{job}"))
    if word == "PENDING" and "held" in str(reason or "").lower():
        named, alive, fix = HELD_PENDING
    return {"slurm": word, "state": named, "alive": alive, "reason": reason or None, "job_id": job or None,
            "fix": fix.format(job=job, reason=reason or "no reason given") if fix else None}
