"""One extraction over a group of hosts: the dataset sharded, every shard detached, one merged result.

``specops extract --on GROUP --run-id R`` with more than one host:

1. **plan** -- every host at once, each bounded by a timeout, one host python each:
   preflight (unless skipped), which runs ``remote/extract/shard.py probe`` in the same process
   from the run plan it made (``remote/extract/runplan.py``: dataset sample count and sha256 of
   the rows used, engine, layer convention and ids, sample format, versions,
   data-parallel width). One recap says which hosts are ready; the run starts only when all are,
   or on the ready ones with ``--allow-partial``. Hosts must agree on the dataset
   (count and sha256), the model, and the stack (layer convention, layer ids, sample
   format): a mixed stack is refused, since mixed files are silent. Once they agree,
   each ready host rehearses on a tiny twin of the model (``specops smoke``; unless
   ``--skip-smoke``), and a host whose rehearsal fails is not ready. The dataset's
   ``[0, total)`` is split into contiguous ranges sized by capacity
   (:mod:`specops.runs.shardmap`), and the map is written to ``runs/R/group.json`` before
   anything starts.
2. **start** -- each shard's run is started detached on its host (``remote/run/job.py``,
   ``sample_range`` in its parameters; run id ``R`` on every host, so the host's run
   dir and output dir are named by the group's id).
3. **follow** -- one rich view: a bar per shard and a total with tokens/s and ETA. A
   host that drops out is marked and the others go on; its last seen progress is kept
   in ``group.json``.
4. **fetch** -- logs, status and manifests of every shard into ``runs/R/hosts/``, and
   once every shard is done, ``runs/R/manifest.json``: one manifest of every sample by
   global index (``--tensors``: the files too, into ``runs/R/samples/``, digest-checked).

The same ``extract --run-id R`` again resumes what is unfinished (the map and the flags
come from ``group.json``); ``--reassign FROM=TO`` moves an unfinished shard's remaining
range -- from the first index not on FROM's disk, read from FROM when it answers, from
its last seen status when it does not -- to TO, as a new shard (run id ``R.<shard>``
there). ``status``, ``logs``, ``abort``, ``fetch`` and ``verify`` with the run id act on every
shard, on the host that holds it now.

Every one of them believes the host's disk, not a status file: a done run whose samples
went missing resumes (``job start`` checks its range on disk) and ``status`` calls it
incomplete; a cut shard's kept range is read again whenever its host answers (a cut made
from a last seen status is unchecked), and a gap there becomes a new shard on that host;
``fetch`` refuses a file whose size differs from the host manifest, and says ok only when
every merged file is in ``runs/R/samples``.

Whether a run id is a group run or each host's own is decided once, by
:func:`specops.runs.run.open_run`; the commands call its verbs.

One module per job: :mod:`~specops.runs.run` (a run by its id, either kind),
:mod:`~specops.runs.store` (``group.json`` on the laptop),
:mod:`~specops.runs.pool` (one connection per shard), :mod:`~specops.runs.plan`,
:mod:`~specops.runs.reassign`, :mod:`~specops.runs.start`, :mod:`~specops.runs.view`
(the follow view and the shard table), :mod:`~specops.runs.extract` (the whole group run),
:mod:`~specops.runs.status` (status, logs, abort), :mod:`~specops.runs.verify`,
:mod:`~specops.runs.fetch` and :mod:`~specops.runs.merge`.
(Parallel steps over hosts, which all of them use, are :mod:`specops.transport.parallel`.)
"""
