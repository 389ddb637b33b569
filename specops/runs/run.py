"""A run by its id, with one set of verbs whether it lives on one host or on a group of hosts.

Every command that acts on a run (``extract``, ``status``, ``logs``, ``abort``, ``fetch``, ``verify``)
asks :func:`open_run` for it and calls the verb; none of them asks "is this a group".
The answer is given here, once:

- a **group run** (:class:`GroupRun`) is one this laptop planned (its shard map,
  ``runs/<run-id>/group.json``, exists), or an extraction asked to be one (several hosts,
  or ``--shard-by``/``--allow-partial``/``--reassign``): one run, the dataset sharded, every
  shard on the host that holds it now (:mod:`specops.runs`);
- otherwise a **host run** (:class:`HostRun`): one shard that is the whole dataset, on
  each selected host under the same run id; its files come back into
  ``runs/<host>/<run-id>/``, the layout a one-host run has always had.

On the host both are the same thing: ``remote/run/job.py`` starts one run per shard
(:func:`specops.runs.start.start_job`), named by the run id, in ``<output_dir>/<run-id>``;
a group's shard adds its ``sample_range``.
"""
from __future__ import annotations

from pathlib import Path

from specops.exit_codes import ExitCode
from specops.inventory import Inventory
from specops.result import STATE, HostReport, overall_exit


class Run:
    """A run id on the selected hosts of an inventory; the verbs are its kind's."""

    #: whether the run is a group run (a shard map on this laptop).
    group = False

    def __init__(self, inventory: Inventory, selector: str | None, run_id: str, accept_new_host_key: bool = False):
        self.inventory, self.selector, self.run_id = inventory, selector, run_id
        self.accept_new_host_key = accept_new_host_key


class HostRun(Run):
    """A run of its own on each selected host (one shard each, the whole dataset)."""

    def _hosts(self) -> list:
        from specops.transport.pool import HostPool

        return HostPool(self.inventory, self.accept_new_host_key).selected(self.selector)

    def _on_hosts(self, task: str, step) -> list[HostReport]:
        from specops.transport.parallel import run_on_hosts

        return run_on_hosts(self.inventory, self.selector, task, step, self.accept_new_host_key)

    def extract(self, overrides: dict, *, detach: bool, force: bool, skip_preflight: bool, as_json: bool,
                tensors: bool, skip_smoke: bool, smoke_real: bool = False, **_group_flags) -> ExitCode:
        """Preflight, smoke, start, follow and fetch on the host (:func:`specops.extract.extract_on`)."""
        from specops.extract import extract_on

        hosts = {h.name: h for h in self._hosts()}
        try:
            return extract_on(self.inventory, hosts, overrides, run_id=self.run_id, detach=detach, force=force,
                              skip_preflight=skip_preflight, as_json=as_json, tensors=tensors, skip_smoke=skip_smoke,
                              smoke_real=smoke_real)
        finally:
            for host in hosts.values():
                host.close()

    def status(self, *, as_json: bool) -> ExitCode:
        from specops.report import print_reports
        from specops.runs import hostjob

        reports = self._on_hosts("status", lambda h: hostjob.status_report(h, self.run_id))
        print_reports(reports, as_json=as_json)
        unreachable = [r for r in reports if r.error is not None]
        if unreachable:
            return overall_exit(unreachable)
        return max(hostjob.job_exit_code(r.data.get("state", STATE.MISSING)) for r in reports)

    def logs(self, *, follow: bool, only: str | None, as_json: bool) -> ExitCode:
        from specops.logs import show_logs

        return show_logs(self._hosts(), self.run_id, follow=follow, only=only, as_json=as_json)

    def abort(self) -> list[HostReport]:
        from specops.runs import hostjob
        from specops.transport.parallel import report_from_payload

        return self._on_hosts("abort", lambda h: report_from_payload(h.name, "abort",
                                                                     hostjob.job_call(h, "abort", self.run_id)))

    def fetch(self, *, tensors: bool, as_json: bool) -> ExitCode:
        from specops.report import print_reports
        from specops.runs import hostjob
        from specops.train import fetch_run  # a train run's artifacts too

        reports = self._on_hosts("fetch", lambda h: fetch_run(h, self.run_id, tensors=tensors))
        print_reports(reports, as_json=as_json)
        if not as_json:
            for report in reports:
                if report.data.get("dest"):
                    hostjob.show_summary(Path(report.data["dest"]))
        return overall_exit(reports)


    def verify(self, *, samples: int, reference: str) -> list[HostReport]:
        from specops.verify import verify_step

        return self._on_hosts("verify", lambda h: verify_step(h, self.run_id, samples, reference))


class GroupRun(Run):
    """One run over a group of hosts: a shard map, every shard on the host that holds it now."""

    group = True

    def extract(self, overrides: dict, *, detach: bool, force: bool, skip_preflight: bool, as_json: bool,
                tensors: bool, skip_smoke: bool, shard_by: str | None = None, allow_partial: bool = False,
                reassign: str | None = None, smoke_real: bool = False) -> ExitCode:
        from specops.runs import extract as group

        return group.extract(self.inventory, self.selector, overrides, run_id=self.run_id, detach=detach, force=force,
                             skip_preflight=skip_preflight, as_json=as_json, tensors=tensors,
                             accept_new_host_key=self.accept_new_host_key, skip_smoke=skip_smoke,
                             shard_by=shard_by, allow_partial=allow_partial, reassign_text=reassign,
                             smoke_real=smoke_real)

    def status(self, *, as_json: bool) -> ExitCode:
        from specops.runs import status as group

        return group.status(self.inventory, self.run_id, as_json=as_json, accept_new_host_key=self.accept_new_host_key)

    def logs(self, *, follow: bool, only: str | None, as_json: bool) -> ExitCode:
        from specops.runs import status as group

        return group.logs(self.inventory, self.run_id, follow_logs=follow, only=only, as_json=as_json,
                          accept_new_host_key=self.accept_new_host_key)

    def abort(self) -> list[HostReport]:
        from specops.runs import status as group

        return group.abort(self.inventory, self.run_id, accept_new_host_key=self.accept_new_host_key)

    def fetch(self, *, tensors: bool, as_json: bool) -> ExitCode:
        from specops.runs import fetch as group

        return group.fetch_run_id(self.inventory, self.run_id, tensors=tensors, as_json=as_json,
                                  accept_new_host_key=self.accept_new_host_key)


    def verify(self, *, samples: int, reference: str) -> list[HostReport]:
        """Every shard, on the host that holds it now."""
        from specops.runs import verify as group

        return group.verify(self.inventory, self.run_id, samples=samples, reference=reference,
                            accept_new_host_key=self.accept_new_host_key)


def open_run(inventory: Inventory, selector: str | None, run_id: str, *, accept_new_host_key: bool = False,
             as_group: bool = False) -> Run:
    """The run called ``run_id``: a :class:`GroupRun` when this laptop holds its shard map or
    ``as_group`` asks for one (an extraction over several hosts, or with a group flag), else a
    :class:`HostRun` on the selected hosts."""
    from specops.runs.store import is_group_run

    kind = GroupRun if as_group or is_group_run(run_id) else HostRun
    return kind(inventory, selector, run_id, accept_new_host_key)


def extract(inventory: Inventory, selector: str | None, overrides: dict, *, run_id: str | None,
            detach: bool, force: bool, skip_preflight: bool, as_json: bool, tensors: bool = False,
            accept_new_host_key: bool = False, skip_smoke: bool = False, shard_by: str | None = None,
            allow_partial: bool = False, reassign: str | None = None, smoke_real: bool = False) -> ExitCode:
    """``specops extract``: the whole extraction flow; returns the exit code.

    More than one host (or a run id this laptop knows as a group run, or a group flag) makes
    one group run, the dataset sharded over the hosts (:mod:`specops.runs`); one host runs the
    whole dataset as one shard (:func:`specops.extract.extract_on`).
    """
    from specops.runid import check_run_id, default_run_id

    from specops.slurm import refuse_array_in_group, refuse_job_replica

    specs = inventory.select(selector)
    run_id = check_run_id(run_id or default_run_id(overrides.get("model") or specs[0].model_path))
    as_group = len(specs) > 1 or bool(shard_by or allow_partial or reassign)
    refuse_array_in_group(specs, as_group)
    refuse_job_replica(inventory, specs, overrides)
    run = open_run(inventory, selector, run_id, accept_new_host_key=accept_new_host_key, as_group=as_group)
    return run.extract(overrides, detach=detach, force=force, skip_preflight=skip_preflight, as_json=as_json,
                       tensors=tensors, skip_smoke=skip_smoke, shard_by=shard_by, allow_partial=allow_partial,
                       reassign=reassign, smoke_real=smoke_real)


def verify(inventory: Inventory, selector: str | None, run_id: str, samples: int = 3, reference: str = "hf",
           accept_new_host_key: bool = False) -> list[HostReport]:
    """``specops verify``: ``run_id`` on every selected host; a group run this laptop started (its
    ``runs/<run-id>/group.json``) shard by shard wherever each is now."""
    from specops.errors import UsageError
    from specops.verify import REFERENCES

    if reference not in REFERENCES:
        raise UsageError(f"--reference {reference!r} is not known", f"use one of: {', '.join(REFERENCES)}")
    if int(samples) < 1:
        raise UsageError(f"--samples {samples!r} must be a positive integer", "example: --samples 3")
    return open_run(inventory, selector, run_id, accept_new_host_key=accept_new_host_key).verify(
        samples=int(samples), reference=reference)
